/* Paged decode attention on CPU: one query token per sequence against its KV blocks, read in
   place through the block table (no gather copy), float32 or bfloat16 cache, float32 math.

   For sequence b, query head j (kv head h = j / G, G = num_heads / num_kv_heads) and context n:
       s_t = scale · q_j · k_{slot(t), h},   slot(t) = table[t / bs] · bs + t % bs,   t < n
       out_j = Σ_t softmax(s)_t · v_{slot(t), h}
   The softmax is exact (two passes: max, then exp-sum); bfloat16 output rounds once, to nearest
   even. With AVX-512 the value pass keeps its accumulators in registers, and a bfloat16 cache takes its
   scores by vdpbf16ps; same math. Head sizes 32, 64 and 128 are compiled as constants.
   Built and loaded by arbor/kernels/cpu_attention.py. */
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
   hardware prefetchers do not follow. Into L2 (prefetcht2), not L1: L1's few miss buffers would cap
   the lines in flight, and with them the bandwidth. */
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* The value pass over a float32 or bfloat16 cache for one kv head h and its G query heads (j = h·G + g, probabilities
   at p + j·n): acc_j = Σ_t p_j[t] · v_t over keys 0..n−1, the G · D/16 float32 accumulators in registers
   (G · D/16 ≤ 16), the next block's rows prefetched; acc: G rows of D floats, written once at the end
   (no stores of converted rows or partial accumulators, which the generic pass makes). */
static inline __attribute__((always_inline)) void v_pass(const void *v_cache, const int bf16, const int32_t *table, int n,
        int block_size, int num_kv_heads, int h, const int D, const int G, const float *p, float *acc) {
    const int V = D / 16, nblocks = (n + block_size - 1) / block_size;
    __m512 a[16], row[8];   /* fixed sizes: registers once the loops unroll */
    for (int i = 0; i < G * V; i++) a[i] = _mm512_setzero_ps();
    const float *pj = p + (long)h * G * n;
    for (int blk = 0; blk < nblocks; blk++) {
        const int t0 = blk * block_size, rows = n - t0 < block_size ? n - t0 : block_size;
        const long base = (long)table[blk] * block_size;
        const long next = blk + 1 < nblocks ? (long)table[blk + 1] * block_size : -1;
        for (int r = 0; r < rows; r++) {
            if (next >= 0) prefetch_row(v_cache, next + r, num_kv_heads, h, D, bf16);
            const long off = ((base + r) * num_kv_heads + h) * D;
            for (int v = 0; v < V; v++)   /* bfloat16 → float32: the 16 bits become the high half */
                row[v] = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_loadu_si256((const __m256i *)((const uint16_t *)v_cache + off + 16 * v))), 16))
                              : _mm512_loadu_ps((const float *)v_cache + off + 16 * v);
            for (int g = 0; g < G; g++) {
                const __m512 pt = _mm512_set1_ps(pj[(long)g * n + t0 + r]);
                for (int v = 0; v < V; v++) a[g * V + v] = _mm512_fmadd_ps(pt, row[v], a[g * V + v]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(acc + g * D + 16 * v, a[g * V + v]);
}
#endif

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
#if defined(__AVX512BF16__)
    if (bf16 && D % 32 == 0 && D <= 128) {
        /* bfloat16 scores straight from the cache (vdpbf16ps): exact products of the unscaled q and k, float32
           sums, scaled after — no converted copy of each key row. */
        const int C = D / 32;
        __m512bh qb[num_heads][4];
        for (int j = 0; j < num_heads; j++)
            for (int c = 0; c < C; c++)
                qb[j][c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + (long)b * q_stride + (long)j * D + 32 * c);
        for (int blk = 0; blk < nblocks; blk++) {
            const int t0 = blk * block_size, rows = n - t0 < block_size ? n - t0 : block_size;
            const long base = (long)table[blk] * block_size;
            const long next = blk + 1 < nblocks ? (long)table[blk + 1] * block_size : -1;
            for (int r = 0; r < rows; r++) {
                for (int h = 0; h < num_kv_heads; h++) {
                    if (next >= 0) prefetch_row(k_cache, next + r, num_kv_heads, h, D, bf16);
                    const uint16_t *row = (const uint16_t *)k_cache + ((base + r) * num_kv_heads + h) * D;
                    __m512bh kb[4];
                    for (int c = 0; c < C; c++) kb[c] = (__m512bh)_mm512_loadu_si512(row + 32 * c);
                    for (int j = h * G; j < (h + 1) * G; j++) {
                        __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[j][0], kb[0]);
                        for (int c = 1; c < C; c++) x = _mm512_dpbf16_ps(x, qb[j][c], kb[c]);
                        const float sc = _mm512_reduce_add_ps(x) * scale;
                        p[(long)j * n + t0 + r] = sc;
                        mx[j] = sc > mx[j] ? sc : mx[j];
                    }
                }
            }
        }
    } else
#endif
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
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 128 && (G == 1 || G == 2 || G == 4 || G == 8) && G * (D / 16) <= 16) {
        for (int h = 0; h < num_kv_heads; h++) {
            switch (G * 2 + !bf16) {   /* G and the dtype constants in each call: the accumulators unroll into registers */
                case 2: v_pass(v_cache, 1, table, n, block_size, num_kv_heads, h, D, 1, p, acc[h]); break;
                case 3: v_pass(v_cache, 0, table, n, block_size, num_kv_heads, h, D, 1, p, acc[h]); break;
                case 4: v_pass(v_cache, 1, table, n, block_size, num_kv_heads, h, D, 2, p, acc[2 * h]); break;
                case 5: v_pass(v_cache, 0, table, n, block_size, num_kv_heads, h, D, 2, p, acc[2 * h]); break;
                case 8: v_pass(v_cache, 1, table, n, block_size, num_kv_heads, h, D, 4, p, acc[4 * h]); break;
                case 9: v_pass(v_cache, 0, table, n, block_size, num_kv_heads, h, D, 4, p, acc[4 * h]); break;
                case 16: v_pass(v_cache, 1, table, n, block_size, num_kv_heads, h, D, 8, p, acc[8 * h]); break;
                default: v_pass(v_cache, 0, table, n, block_size, num_kv_heads, h, D, 8, p, acc[8 * h]); break;
            }
        }
    } else
#endif
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
        if (head_dim == 32)
            attend_seq(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, num_heads, num_kv_heads, 32, block_size, scale, p);
        else if (head_dim == 64)
            attend_seq(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, num_heads, num_kv_heads, 64, block_size, scale, p);
        else if (head_dim == 128)
            attend_seq(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, num_heads, num_kv_heads, 128, block_size, scale, p);
        else
            attend_seq(q, k_cache, v_cache, out, bf16, table, n, q_stride, b, num_heads, num_kv_heads, head_dim, block_size, scale, p);
        free(p);
    }
}
