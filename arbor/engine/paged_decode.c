/* Paged decode attention on CPU: one query token per sequence against its KV blocks, read in
   place through the block table (no gather copy), float32 or bfloat16 cache, float32 math.

   For sequence b, query head j (kv head h = j / G, G = num_heads / num_kv_heads) and context n:
       s_t = scale · q_j · k_{slot(t), h},   slot(t) = table[t / bs] · bs + t % bs,   t < n
       out_j = Σ_t softmax(s)_t · v_{slot(t), h}
   The softmax is exact (two passes: max, then exp-sum); bfloat16 output rounds once, to nearest
   even. Built and loaded by arbor/engine/cpu_attention.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (uint16_t)(u >> 16); }

/* D floats from element `offset` of a float32 or bfloat16 array. */
static inline __attribute__((always_inline)) void load(const void *base, long offset, int bf16, int D, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + offset;
        #pragma omp simd
        for (int i = 0; i < D; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)D * sizeof(float));
    }
}

/* Asks for row `slot` of head h ahead of its use (one block ahead): rows jump between blocks, which
   hardware prefetchers do not follow. Into L2 (prefetcht2), not L1: L1's few miss buffers capped the
   lines in flight, and with them the bandwidth (float32, 256 sequences of 80–640 keys, one core:
   ~7.5 → 13–19 GB/s of KV; bfloat16 ~8 → ~10). */
static inline __attribute__((always_inline)) void prefetch_row(const void *cache, long slot, int num_kv_heads, int h,
                                                              int D, int bf16) {
    const char *p = (const char *)cache + (slot * num_kv_heads + h) * D * (bf16 ? 2 : 4);
    for (int off = 0; off < D * (bf16 ? 2 : 4); off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* Row `slot` of head h as float32: in place for a float32 cache, converted into `buf` for bfloat16. */
static inline __attribute__((always_inline)) const float *row_at(const void *cache, long slot, int num_kv_heads, int h,
                                                                int D, int bf16, float *buf) {
    long off = (slot * num_kv_heads + h) * D;
    if (!bf16) return (const float *)cache + off;
    load(cache, off, 1, D, buf);
    return buf;
}

/* One sequence, every head: its query heads against keys 0..n-1, walked block by block (no division
   per key) and slot by slot with all kv heads of a slot together, so each block is read as one
   contiguous run. D is a compile-time constant at the call sites below, so the head-sized loops
   unroll into registers. p: scratch of num_heads · n floats. */
static inline __attribute__((always_inline)) void attend_seq(
        const void *q, const void *k_cache, const void *v_cache, void *out, int bf16, const int32_t *table, int n,
        long q_stride, int b, int num_heads, int num_kv_heads, const int D, int block_size, float scale, float *p) {
    const int G = num_heads / num_kv_heads, nblocks = (n + block_size - 1) / block_size;
    float qf[num_heads][D], acc[num_heads][D], buf[D], mx[num_heads];
    for (int j = 0; j < num_heads; j++) {
        load(q, (long)b * q_stride + (long)j * D, bf16, D, qf[j]);
        for (int i = 0; i < D; i++) { qf[j][i] *= scale; acc[j][i] = 0.f; }
        mx[j] = -FLT_MAX;
    }
    for (int blk = 0; blk < nblocks; blk++) {
        const int t0 = blk * block_size, rows = n - t0 < block_size ? n - t0 : block_size;
        const long base = (long)table[blk] * block_size;
        const long next = blk + 1 < nblocks ? (long)table[blk + 1] * block_size : -1;
        for (int r = 0; r < rows; r++) {
            for (int h = 0; h < num_kv_heads; h++) {
                if (next >= 0) prefetch_row(k_cache, next + r, num_kv_heads, h, D, bf16);
                const float *row = row_at(k_cache, base + r, num_kv_heads, h, D, bf16, buf);
                for (int j = h * G; j < (h + 1) * G; j++) {
                    float s = 0.f;
                    #pragma omp simd reduction(+:s)
                    for (int i = 0; i < D; i++) s += qf[j][i] * row[i];
                    p[(long)j * n + t0 + r] = s;
                    mx[j] = s > mx[j] ? s : mx[j];
                }
            }
        }
    }
    for (int j = 0; j < num_heads; j++) {
        float *pj = p + (long)j * n, m = mx[j], z = 0.f;
        #pragma omp simd reduction(+:z)
        for (int t = 0; t < n; t++) { pj[t] = expf(pj[t] - m); z += pj[t]; }
        mx[j] = 1.f / z;   /* from here on: the normaliser */
    }
    for (int blk = 0; blk < nblocks; blk++) {
        const int t0 = blk * block_size, rows = n - t0 < block_size ? n - t0 : block_size;
        const long base = (long)table[blk] * block_size;
        const long next = blk + 1 < nblocks ? (long)table[blk + 1] * block_size : -1;
        for (int r = 0; r < rows; r++) {
            for (int h = 0; h < num_kv_heads; h++) {
                if (next >= 0) prefetch_row(v_cache, next + r, num_kv_heads, h, D, bf16);
                const float *row = row_at(v_cache, base + r, num_kv_heads, h, D, bf16, buf);
                for (int j = h * G; j < (h + 1) * G; j++) {
                    const float pt = p[(long)j * n + t0 + r];
                    #pragma omp simd
                    for (int i = 0; i < D; i++) acc[j][i] += pt * row[i];
                }
            }
        }
    }
    for (int j = 0; j < num_heads; j++) {
        long o = ((long)b * num_heads + j) * D;
        if (bf16) { for (int i = 0; i < D; i++) ((uint16_t *)out)[o + i] = f32_to_bf16(acc[j][i] * mx[j]); }
        else { for (int i = 0; i < D; i++) ((float *)out)[o + i] = acc[j][i] * mx[j]; }
    }
}

void paged_decode_attention(const void *q, long q_stride, const void *k_cache, const void *v_cache, void *out, int bf16,
                            const int32_t *block_tables, int table_width, const int32_t *context_lens,
                            int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int num_threads) {
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int b = 0; b < num_seqs; b++) {
        const int n = context_lens[b];
        const int32_t *table = block_tables + (long)b * table_width;
        float *p = malloc(sizeof(float) * (size_t)num_heads * n);
        if (head_dim == 64)
            attend_seq(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, num_heads, num_kv_heads, 64, block_size, scale, p);
        else if (head_dim == 128)
            attend_seq(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, num_heads, num_kv_heads, 128, block_size, scale, p);
        else
            attend_seq(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, num_heads, num_kv_heads, head_dim, block_size, scale, p);
        free(p);
    }
}
