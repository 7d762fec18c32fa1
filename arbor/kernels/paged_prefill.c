/* Paged prefill attention on CPU (AVX-512): chunks of query tokens against their sequence's keys in
   the paged cache (their own keys already written there), causal, float32 or bfloat16 cache and
   queries, float32 math.

   Chunk c of n query tokens after `context` cached ones: query i (position context + i), head j,
   kv head h = j / G, sees keys 0..context+i:
       out_{i,j} = Σ_t softmax_t(scale · q_{i,j} · k_{t,h}) v_{t,h}
   One task = (chunk, query head, tile of 16 query tokens). Its 16 queries are the 16 lanes of a
   register ("transposed": Qt[d] holds dimension d of all 16), so a key row is read once per tile
   and broadcast element by element: the 16 keys of a cache row group give 16 registers of scores,
   one per key, each over the 16 queries — the softmax max and sum are lane-wise, no horizontal
   reductions. Online softmax per group of 16 keys (running max m, sum l, out rescaled by
   exp(m_old − m_new)); masked scores get probability exactly 0. Output Ot [D][16] (4 KB for D = 64)
   stays in L1, updated 8 dimensions at a time in registers.
   block_size must be a multiple of 16 (a group of 16 keys is contiguous in one cache block).
   Built and loaded by arbor/kernels/cpu_attention.py. */
#include <float.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

int paged_prefill_available(void) { return 1; }

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* e^x for x ≤ 0 (inputs below −87 give ~0; callers mask what must be exactly 0): 2^(x·log2 e) split
   into 2^n · 2^f, f ∈ [−0.5, 0.5], 2^f by a degree-6 polynomial (relative error < 2e-7). */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 rows of D values of kv head h from the cache, starting at `slot` (consecutive slots), as float32
   rows of D floats back to back in dst (bfloat16 converted). Copied even in float32: rows of one head
   lie num_kv_heads · D floats apart, 4 KB for 8 heads of 128 — the same L1 set for all 16 rows. */
static inline __attribute__((always_inline)) const float *rows16(const void *cache, long slot, int num_kv_heads,
                                                                int h, const int D, int bf16, float *dst) {
    const long stride = (long)num_kv_heads * D;
    if (!bf16) {
        const float *src = (const float *)cache + slot * stride + (long)h * D;
        for (int r = 0; r < 16; r++)
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + r * D + d, _mm512_loadu_ps(src + r * stride + d));
        return dst;
    }
    const uint16_t *src = (const uint16_t *)cache + slot * stride + (long)h * D;
    for (int r = 0; r < 16; r++)
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(dst + r * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + r * stride + d))), 16)));
    return dst;
}

/* One task: queries i0..i0+nq−1 (nq ≤ 16) of a chunk, head j. */
static inline __attribute__((always_inline)) void prefill_tile(
        const void *q, long q_stride, const void *k_cache, const void *v_cache, void *out, int bf16,
        const int32_t *table, int context, int q_row0, int i0, int nq, int j, int num_heads, int num_kv_heads,
        const int D, int block_size, float scale) {
    const int h = j / (num_heads / num_kv_heads);
    float qt[D * 16] __attribute__((aligned(64))), ot[D * 16] __attribute__((aligned(64)));
    float kbuf[16 * D] __attribute__((aligned(64))), vbuf[16 * D] __attribute__((aligned(64)));
    memset(qt, 0, sizeof(qt));
    memset(ot, 0, sizeof(ot));
    for (int r = 0; r < nq; r++) {   /* transpose the tile's queries, scaled */
        const long off = (long)(q_row0 + i0 + r) * q_stride + (long)j * D;
        for (int d = 0; d < D; d++)
            qt[d * 16 + r] = scale * (bf16 ? bf16_to_f32(((const uint16_t *)q)[off + d]) : ((const float *)q)[off + d]);
    }
    const long stride = D;   /* between the rows rows16 returns */
    /* lane r sees keys ≤ context + i0 + r; the tile's last key: */
    const int last = context + i0 + nq - 1;
    const __m512i lane_limit = _mm512_add_epi32(_mm512_set1_epi32(context + i0), _mm512_set_epi32(
        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
    for (int t0 = 0; t0 <= last; t0 += 16) {
        const long slot = (long)table[t0 / block_size] * block_size + t0 % block_size;
        const float *kr = rows16(k_cache, slot, num_kv_heads, h, D, bf16, kbuf);
        const int nk = last - t0 + 1 < 16 ? last - t0 + 1 : 16;   /* keys past `last` are not read */
        __m512 s[16];
        for (int t = 0; t < 16; t++) s[t] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 qd = _mm512_load_ps(qt + d * 16);
            for (int t = 0; t < 16; t++)
                if (t < nk) s[t] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kr[t * stride + d]), s[t]);
        }
        __mmask16 valid[16];
        __m512 mx = m;
        for (int t = 0; t < 16; t++) {
            valid[t] = t < nk ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(t0 + t), lane_limit, _MM_CMPINT_LE) : 0;
            mx = _mm512_mask_max_ps(mx, valid[t], mx, s[t]);
        }
        const __m512 alpha = exp512(_mm512_sub_ps(m, mx));
        m = mx;
        l = _mm512_mul_ps(l, alpha);
        for (int t = 0; t < 16; t++) {
            s[t] = _mm512_maskz_mov_ps(valid[t], exp512(_mm512_sub_ps(s[t], m)));
            l = _mm512_add_ps(l, s[t]);
        }
        const float *vr = rows16(v_cache, slot, num_kv_heads, h, D, bf16, vbuf);
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m512 o[8];
            for (int d = 0; d < 8; d++) o[d] = _mm512_mul_ps(_mm512_load_ps(ot + (d0 + d) * 16), alpha);
            for (int t = 0; t < 16; t++)
                if (t < nk)
                    for (int d = 0; d < 8; d++) o[d] = _mm512_fmadd_ps(s[t], _mm512_set1_ps(vr[t * stride + d0 + d]), o[d]);
            for (int d = 0; d < 8; d++) _mm512_store_ps(ot + (d0 + d) * 16, o[d]);
        }
    }
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int r = 0; r < nq; r++) {
        const long o = ((long)(q_row0 + i0 + r) * num_heads + j) * D;
        for (int d = 0; d < D; d++) {
            const float x = ot[d * 16 + r] * inv[r];
            if (bf16) { uint32_t u; memcpy(&u, &x, 4); u += 0x7FFFu + ((u >> 16) & 1u); ((uint16_t *)out)[o + d] = (uint16_t)(u >> 16); }
            else ((float *)out)[o + d] = x;
        }
    }
}

/* q rows q_row0[c] .. + q_len[c] − 1 (row stride q_stride elements, heads contiguous) attend over
   keys 0..context[c]+q_len[c]−1 of block table row c; out [rows, num_heads, head_dim] contiguous,
   rows numbered as q's. head_dim ∈ {64, 128} or any multiple of 16 up to 256. */
void paged_prefill_attention(const void *q, long q_stride, const void *k_cache, const void *v_cache, void *out,
                             int bf16, const int32_t *block_tables, int table_width, const int32_t *q_row0,
                             const int32_t *q_len, const int32_t *context, int num_chunks, int num_heads,
                             int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    int tasks = 0;
    for (int c = 0; c < num_chunks; c++) tasks += (q_len[c] + 15) / 16 * num_heads;
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int task = 0; task < tasks; task++) {
        int c = 0, rest = task;   /* chunk of this task: a walk, the chunks are few */
        while (rest >= (q_len[c] + 15) / 16 * num_heads) { rest -= (q_len[c] + 15) / 16 * num_heads; c++; }
        const int tile = rest / num_heads, j = rest % num_heads, i0 = tile * 16;
        const int nq = q_len[c] - i0 < 16 ? q_len[c] - i0 : 16;
        const int32_t *table = block_tables + (long)c * table_width;
        if (head_dim == 64)
            prefill_tile(q, q_stride, k_cache, v_cache, out, bf16, table, context[c], q_row0[c], i0, nq, j, num_heads,
                         num_kv_heads, 64, block_size, scale);
        else if (head_dim == 128)
            prefill_tile(q, q_stride, k_cache, v_cache, out, bf16, table, context[c], q_row0[c], i0, nq, j, num_heads,
                         num_kv_heads, 128, block_size, scale);
        else
            prefill_tile(q, q_stride, k_cache, v_cache, out, bf16, table, context[c], q_row0[c], i0, nq, j, num_heads,
                         num_kv_heads, head_dim, block_size, scale);
    }
}
#else
int paged_prefill_available(void) { return 0; }
void paged_prefill_attention(void) {}
#endif
