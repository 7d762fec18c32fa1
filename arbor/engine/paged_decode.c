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

#ifndef AHEAD
#define AHEAD 16   /* rows ahead: one block of the default size */
#endif
/* Asks for key/value row t ahead of its use: rows jump between blocks, which hardware
   prefetchers do not follow. */
static inline void prefetch_row(const void *cache, const int32_t *table, int t, int block_size, int num_kv_heads,
                                int h, int D, int bf16) {
    long slot = (long)table[t / block_size] * block_size + t % block_size;
    const char *p = (const char *)cache + (slot * num_kv_heads + h) * D * (bf16 ? 2 : 4);
    for (int off = 0; off < D * (bf16 ? 2 : 4); off += 64) __builtin_prefetch(p + off);
}

/* One (sequence, kv head): its G query heads against keys 0..n-1. D is a compile-time constant
   at the call sites below, so the head-sized loops unroll into registers. */
static inline __attribute__((always_inline)) void attend_head(
        const void *q, const void *k_cache, const void *v_cache, void *out, int bf16, const int32_t *table, int n,
        long q_stride, int b, int h, int num_heads, int num_kv_heads, int G, const int D, int block_size, float scale,
        float *p) {
    float qf[G][D], acc[G][D], row[D], mx[G], z[G];
    for (int g = 0; g < G; g++) {
        load(q, (long)b * q_stride + (long)(h * G + g) * D, bf16, D, qf[g]);
        for (int i = 0; i < D; i++) { qf[g][i] *= scale; acc[g][i] = 0.f; }
        mx[g] = -FLT_MAX;
        z[g] = 0.f;
    }
    for (int t = 0; t < n; t++) {
        long slot = (long)table[t / block_size] * block_size + t % block_size;
        if (t + AHEAD < n) prefetch_row(k_cache, table, t + AHEAD, block_size, num_kv_heads, h, D, bf16);
        load(k_cache, (slot * num_kv_heads + h) * D, bf16, D, row);
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            #pragma omp simd reduction(+:s)
            for (int i = 0; i < D; i++) s += qf[g][i] * row[i];
            p[g * n + t] = s;
            mx[g] = s > mx[g] ? s : mx[g];
        }
    }
    for (int g = 0; g < G; g++) {
        float *pg = p + g * n, m = mx[g], zg = 0.f;
        #pragma omp simd reduction(+:zg)
        for (int t = 0; t < n; t++) { pg[t] = expf(pg[t] - m); zg += pg[t]; }
        z[g] = zg;
    }
    for (int t = 0; t < n; t++) {
        long slot = (long)table[t / block_size] * block_size + t % block_size;
        if (t + AHEAD < n) prefetch_row(v_cache, table, t + AHEAD, block_size, num_kv_heads, h, D, bf16);
        load(v_cache, (slot * num_kv_heads + h) * D, bf16, D, row);
        for (int g = 0; g < G; g++) {
            float pt = p[g * n + t];
            #pragma omp simd
            for (int i = 0; i < D; i++) acc[g][i] += pt * row[i];
        }
    }
    for (int g = 0; g < G; g++) {
        long o = ((long)b * num_heads + h * G + g) * D;
        float inv = 1.f / z[g];
        if (bf16) { for (int i = 0; i < D; i++) ((uint16_t *)out)[o + i] = f32_to_bf16(acc[g][i] * inv); }
        else { for (int i = 0; i < D; i++) ((float *)out)[o + i] = acc[g][i] * inv; }
    }
}

void paged_decode_attention(const void *q, long q_stride, const void *k_cache, const void *v_cache, void *out, int bf16,
                            const int32_t *block_tables, int table_width, const int32_t *context_lens,
                            int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int num_threads) {
    const int G = num_heads / num_kv_heads;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int b = 0; b < num_seqs; b++) {
        for (int h = 0; h < num_kv_heads; h++) {
            const int n = context_lens[b];
            const int32_t *table = block_tables + (long)b * table_width;
            float *p = malloc(sizeof(float) * (size_t)G * n);
            if (head_dim == 64)
                attend_head(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, h, num_heads, num_kv_heads, G, 64, block_size, scale, p);
            else if (head_dim == 128)
                attend_head(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, h, num_heads, num_kv_heads, G, 128, block_size, scale, p);
            else
                attend_head(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, h, num_heads, num_kv_heads, G, head_dim, block_size, scale, p);
            free(p);
        }
    }
}
