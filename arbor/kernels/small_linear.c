/* Linear layers for decode-sized steps on CPU (AVX-512): y = x Wᵀ + b for few rows of x.

   For M rows of x [M, K] and W [N, K]:  y[m, n] = b[n] + Σ_k x[m, k] · W[n, k]
   (float32 sums in k order, y rounded once to x's dtype).
   - bfloat16: W packed two inputs at a time ("VNNI", as moe_experts.c): [N/16][K/2][16][2]; one 64-byte
     load = 16 output columns × 2 inputs; one vdpbf16ps with a broadcast input pair adds their exact
     products into 16 float32 sums.
   - float32: W packed [N/16][K][16]; one FMA per input with a broadcast x value.
   A tile is 16 output columns × up to 16 rows: 16 float32 accumulators in registers, one weight register,
   the x values broadcast from a transposed copy ([K][16] per 16 rows, one base pointer), so each weight
   load feeds up to 16 FMAs. Each thread takes a contiguous range of column blocks: one sequential run of
   the packed weights, prefetched PREFETCH bytes ahead (rows past the first 16 re-read their block from L2).

   Why: at 8–64 rows a step is neither bound by memory nor by compute alone; oneDNN's packed GEMM
   (arbor/engine/cpu_linear.py) is tuned for larger row counts and, on AVX-512 without AMX, reaches about
   half this CPU's vdpbf16ps rate at 16 rows. With loads far ahead the FMAs and the weight stream overlap.
   Built by arbor/kernels/native.py; without AVX-512 (BF16 for bfloat16) the *_available() calls say 0. */
#include <stdint.h>
#include <stdlib.h>

#define PREFETCH 8192   /* bytes ahead of the weight loads: measured 1 KiB ≈ oneDNN, 4 KiB +34 %, 8 KiB best */

#if defined(__AVX512F__)
#include <immintrin.h>

/* x [M, G] of 32-bit groups (a float32 value, or a pair of bfloat16 inputs), rows contiguous →
   xt [ceil(M/16)][G][16]: per tile of 16 rows, group g of every row side by side; rows past M zero. */
static int32_t *transpose_rows(const int32_t *x, int M, int G) {
    const int tiles = (M + 15) / 16;
    int32_t *xt = aligned_alloc(64, (size_t)tiles * G * 16 * sizeof(int32_t));
    if (!xt) return NULL;
    for (int t = 0; t < tiles; t++)
        for (int g = 0; g < G; g++)
            for (int r = 0; r < 16; r++) {
                const int m = t * 16 + r;
                xt[((long)t * G + g) * 16 + r] = m < M ? x[(long)m * G + g] : 0;
            }
    return xt;
}

/* Float32 tile: n rows (a constant at each call site: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_f32(const int n, const float *xt, int K, const float *w,
                                                          const float *bias, float *y, int N) {
    __m512 a[16];
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < n; r++) a[r] = b0;
    for (int k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w + k * 16) + PREFETCH, _MM_HINT_T0);
        __m512 b = _mm512_loadu_ps(w + k * 16);
        __asm__("" : "+v"(b));   /* one load per 16 FMAs, not one folded into each */
        for (int r = 0; r < n; r++) a[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(xt[k * 16 + r]), a[r]);
    }
    for (int r = 0; r < n; r++) _mm512_storeu_ps(y + (long)r * N, a[r]);
}

#define ROWS_SWITCH(fn, n, ...) switch (n) { \
    case 1: fn(1, __VA_ARGS__); break; case 2: fn(2, __VA_ARGS__); break; case 3: fn(3, __VA_ARGS__); break; \
    case 4: fn(4, __VA_ARGS__); break; case 5: fn(5, __VA_ARGS__); break; case 6: fn(6, __VA_ARGS__); break; \
    case 7: fn(7, __VA_ARGS__); break; case 8: fn(8, __VA_ARGS__); break; case 9: fn(9, __VA_ARGS__); break; \
    case 10: fn(10, __VA_ARGS__); break; case 11: fn(11, __VA_ARGS__); break; case 12: fn(12, __VA_ARGS__); break; \
    case 13: fn(13, __VA_ARGS__); break; case 14: fn(14, __VA_ARGS__); break; case 15: fn(15, __VA_ARGS__); break; \
    default: fn(16, __VA_ARGS__); break; }

int small_linear_f32_available(void) { return 1; }

/* x [M, K], w = [N/16][K][16], bias [N] or NULL, y [M, N]; N % 16 == 0. → 0, or −1 when out of memory. */
int small_linear_f32(const float *x, int M, int K, const float *w, const float *bias, int N, float *y,
                     int num_threads) {
    const float *xt = (const float *)transpose_rows((const int32_t *)x, M, K);
    if (!xt) return -1;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < N / 16; c++)
        for (int m = 0; m < M; m += 16) {
            const int n = M - m < 16 ? M - m : 16;
            ROWS_SWITCH(tile_f32, n, xt + (long)m * K, K, w + (long)c * K * 16, bias ? bias + c * 16 : NULL,
                        y + (long)m * N + c * 16, N)
        }
    free((void *)xt);
    return 0;
}

#if defined(__AVX512BF16__)
static inline float bf16_to_f32(uint16_t h) { union { uint32_t u; float f; } v = { (uint32_t)h << 16 }; return v.f; }

/* Bfloat16 tile: xt holds input pairs, [K/2][16] of 32 bits. */
static inline __attribute__((always_inline)) void tile_bf16(const int n, const int32_t *xt, int K, const uint16_t *w,
                                                           const uint16_t *bias, uint16_t *y, int N) {
    __m512 a[16];
    __m512 b0 = _mm512_setzero_ps();
    if (bias) {
        float bf[16];
        for (int i = 0; i < 16; i++) bf[i] = bf16_to_f32(bias[i]);
        b0 = _mm512_loadu_ps(bf);
    }
    for (int r = 0; r < n; r++) a[r] = b0;
    for (int kp = 0; kp < K / 2; kp++) {
        _mm_prefetch((const char *)(w + kp * 32) + PREFETCH, _MM_HINT_T0);
        __m512bh b = (__m512bh)_mm512_loadu_si512(w + kp * 32);
        __asm__("" : "+v"(b));
        for (int r = 0; r < n; r++)
            a[r] = _mm512_dpbf16_ps(a[r], b, (__m512bh)_mm512_set1_epi32(xt[kp * 16 + r]));
    }
    for (int r = 0; r < n; r++)
        _mm256_storeu_si256((__m256i *)(y + (long)r * N), (__m256i)_mm512_cvtneps_pbh(a[r]));
}

int small_linear_bf16_available(void) { return 1; }

/* x [M, K], w = [N/16][K/2][16][2], bias [N] or NULL, y [M, N], all bfloat16; K % 2 == 0, N % 16 == 0. */
int small_linear_bf16(const uint16_t *x, int M, int K, const uint16_t *w, const uint16_t *bias, int N,
                      uint16_t *y, int num_threads) {
    const int32_t *xt = transpose_rows((const int32_t *)x, M, K / 2);
    if (!xt) return -1;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int c = 0; c < N / 16; c++)
        for (int m = 0; m < M; m += 16) {
            const int n = M - m < 16 ? M - m : 16;
            ROWS_SWITCH(tile_bf16, n, xt + (long)m * (K / 2), K, w + (long)c * K * 16, bias ? bias + c * 16 : NULL,
                        y + (long)m * N + c * 16, N)
        }
    free((void *)xt);
    return 0;
}
#else
int small_linear_bf16_available(void) { return 0; }
#endif
#else
int small_linear_f32_available(void) { return 0; }
int small_linear_bf16_available(void) { return 0; }
#endif
