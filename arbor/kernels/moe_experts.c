/* Routed MoE experts in bfloat16 on CPU (AVX-512 BF16): each token runs only through its k experts.

   For token t with experts e_j and routing weights w_j (j < k), I = moe intermediate size:
       g, u = x_t G_eᵀ, x_t U_eᵀ          (float32 sums of bfloat16 products, vdpbf16ps)
       h    = bf16(silu(g) · u)            (rounded once, as the PyTorch path's silu_mul output)
       y_t  = bf16(Σ_j w_j · h_{t,j} D_eᵀ) (float32 accumulation over the k experts, rounded once)
   Weights come packed two rows of k at a time ("VNNI"): gate_up as [E][2I/16][D/2][16][2], down as
   [E][D/16][I/2][16][2], so one 64-byte load holds 16 output columns × 2 inputs and one vdpbf16ps
   with a broadcast input pair adds them into 16 float32 sums.

   Two parallel phases over (expert, 16-column block) tasks: (A) gate and up blocks together → h of
   every routed (token, expert) pair; (B) per block of 16 output columns, every expert's pairs,
   weighted and summed per token in registers/stack, so no two threads write the same output.
   The PyTorch path (per-expert GEMMs, or all experts densely for a few tokens) computes E / k times
   the FLOPs or pays a call per expert; see arbor/engine/cpu_linear.py. Built by arbor/kernels/native.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

int moe_experts_bf16_available(void) { return 1; }

#define RB 8   /* rows per register tile: 2 · RB gate/up accumulators + 2 weight registers ≤ 32 */

/* A tile's row count as a compile-time constant (one specialised copy per count), so its accumulators
   stay in registers: with a run-time count GCC spills them to the stack on every input pair. */
#define ROWS8(fn, n, ...) switch (n) { \
    case 1: fn(1, __VA_ARGS__); break; case 2: fn(2, __VA_ARGS__); break; case 3: fn(3, __VA_ARGS__); break; \
    case 4: fn(4, __VA_ARGS__); break; case 5: fn(5, __VA_ARGS__); break; case 6: fn(6, __VA_ARGS__); break; \
    case 7: fn(7, __VA_ARGS__); break; default: fn(8, __VA_ARGS__); break; }
#define ROWS16(fn, n, ...) switch (n) { \
    case 9: fn(9, __VA_ARGS__); break; case 10: fn(10, __VA_ARGS__); break; case 11: fn(11, __VA_ARGS__); break; \
    case 12: fn(12, __VA_ARGS__); break; case 13: fn(13, __VA_ARGS__); break; case 14: fn(14, __VA_ARGS__); break; \
    case 15: fn(15, __VA_ARGS__); break; case 16: fn(16, __VA_ARGS__); break; default: ROWS8(fn, n, __VA_ARGS__) }

/* 16 float32 → 16 bfloat16, round to nearest even. */
static inline __attribute__((always_inline)) void store_bf16(uint16_t *dst, __m512 v) {
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Phase A for rows[0..n) (n ≤ RB) of one expert and one 16-column block: wg, wu point at the
   block's packed gate and up columns ([K/2][16][2]); h rows get 16 bf16 values each. */
static inline __attribute__((always_inline)) void gate_up_tile(const int n, const uint16_t *x, int D, const int32_t *rows,
        const uint16_t *wg, const uint16_t *wu, uint16_t *h, int I, int p0, int col) {
    __m512 g[RB], u[RB];
    for (int r = 0; r < RB; r++) { g[r] = _mm512_setzero_ps(); u[r] = _mm512_setzero_ps(); }
    const int32_t *xr[RB];
    for (int r = 0; r < n; r++) xr[r] = (const int32_t *)(x + (long)rows[r] * D);
    for (int kp = 0; kp < D / 2; kp++) {
        __m512bh a = (__m512bh)_mm512_loadu_si512(wg + kp * 32), b = (__m512bh)_mm512_loadu_si512(wu + kp * 32);
        for (int r = 0; r < n; r++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r][kp]);
            g[r] = _mm512_dpbf16_ps(g[r], a, xb);
            u[r] = _mm512_dpbf16_ps(u[r], b, xb);
        }
    }
    for (int r = 0; r < n; r++) {
        float gs[16], us[16];
        _mm512_storeu_ps(gs, g[r]); _mm512_storeu_ps(us, u[r]);
        #pragma omp simd
        for (int i = 0; i < 16; i++) {     /* e^{−g} clamped: -ffast-math assumes expf never overflows */
            const float z = -gs[i] < 88.f ? -gs[i] : 88.f;
            gs[i] = gs[i] / (1.0f + expf(z)) * us[i];
        }
        store_bf16(h + (long)(p0 + r) * I + col, _mm512_loadu_ps(gs));
    }
}

/* Phase B for pairs p0..p0+n−1 (n ≤ 2·RB) of one expert and one 16-column block of the output:
   acc_r = h_{p} D_e[block]ᵀ, then y[token] += w · acc_r. */
static inline __attribute__((always_inline)) void down_tile(const int n, const uint16_t *h, int I, int p0,
        const uint16_t *wd, const int32_t *token, const float *weight, float *y) {
    __m512 acc[2 * RB];
    for (int r = 0; r < 2 * RB; r++) acc[r] = _mm512_setzero_ps();
    const int32_t *hr = (const int32_t *)(h + (long)p0 * I);
    for (int kp = 0; kp < I / 2; kp++) {
        __m512bh a = (__m512bh)_mm512_loadu_si512(wd + kp * 32);
        for (int r = 0; r < n; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], a, (__m512bh)_mm512_set1_epi32(hr[(long)r * (I / 2) + kp]));
    }
    for (int r = 0; r < n; r++) {
        float *yt = y + (long)token[p0 + r] * 16;
        _mm512_storeu_ps(yt, _mm512_fmadd_ps(_mm512_set1_ps(weight[p0 + r]), acc[r], _mm512_loadu_ps(yt)));
    }
}

/* x [T, D] bf16; ids [T, k] int64; weights [T, k] float32; gate_up [E][2I/16][D/2][16][2] and
   down [E][D/16][I/2][16][2] bf16 (see above); y [T, D] bf16. D % 16 == 0, I % 16 == 0.
   → 0, or −1 (nothing computed, y untouched) when an id is outside 0..E−1. */
int moe_experts_bf16(const uint16_t *x, int T, const int64_t *ids, const float *weights, int k,
                      const uint16_t *gate_up, const uint16_t *down, int E, int D, int I, uint16_t *y,
                      int num_threads) {
    const int P = T * k, NB1 = I / 16, NB2 = D / 16;
    for (int i = 0; i < P; i++)
        if (ids[i] < 0 || ids[i] >= E) return -1;
    int32_t *start = calloc((size_t)E + 1, sizeof(int32_t)), *fill = malloc(sizeof(int32_t) * (size_t)E);
    int32_t *token = malloc(sizeof(int32_t) * (size_t)P);
    float *weight = malloc(sizeof(float) * (size_t)P);
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)P * I);
    /* pairs sorted by expert (counting sort, stable in token order) */
    for (int i = 0; i < P; i++) start[ids[i] + 1]++;
    for (int e = 0; e < E; e++) { start[e + 1] += start[e]; fill[e] = start[e]; }
    for (int i = 0; i < P; i++) {
        int p = fill[ids[i]]++;
        token[p] = i / k; weight[p] = weights[i];
    }
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(dynamic) collapse(2)
        for (int e = 0; e < E; e++)
            for (int nb = 0; nb < NB1; nb++) {
                const uint16_t *wg = gate_up + ((long)e * 2 * NB1 + nb) * D * 16;
                const uint16_t *wu = gate_up + ((long)e * 2 * NB1 + NB1 + nb) * D * 16;
                for (int p = start[e]; p < start[e + 1]; p += RB) {
                    int n = start[e + 1] - p < RB ? start[e + 1] - p : RB, rows[RB];
                    for (int r = 0; r < n; r++) rows[r] = token[p + r];
                    ROWS8(gate_up_tile, n, x, D, rows, wg, wu, h, I, p, nb * 16)
                }
            }
        #pragma omp for schedule(dynamic)
        for (int nb = 0; nb < NB2; nb++) {
            float *acc = calloc((size_t)T * 16, sizeof(float));
            for (int e = 0; e < E; e++) {
                const uint16_t *wd = down + ((long)e * NB2 + nb) * I * 16;
                for (int p = start[e]; p < start[e + 1]; p += 2 * RB) {
                    const int n = start[e + 1] - p < 2 * RB ? start[e + 1] - p : 2 * RB;
                    ROWS16(down_tile, n, h, I, p, wd, token, weight, acc)
                }
            }
            for (int t = 0; t < T; t++) store_bf16(y + (long)t * D + nb * 16, _mm512_loadu_ps(acc + (long)t * 16));
            free(acc);
        }
    }
    free(start); free(fill); free(token); free(weight); free(h);
    return 0;
}

/* The router and the experts in one call, for a step without replayed ids: logits [T, E] bf16 (the
   router GEMM's output) → probs [T, E] = softmax(logits) in float32; ids [T, k] = its top k (larger
   first, the lower expert on a tie); w = probs[ids], divided by their sum when `norm`, then rounded to
   bf16 as the PyTorch path's ``weights.to(x.dtype)``; y as moe_experts_bf16. */
void moe_route_experts_bf16(const uint16_t *x, const uint16_t *logits, int T, int k, int norm, float *probs,
                            int64_t *ids, const uint16_t *gate_up, const uint16_t *down, int E, int D, int I,
                            uint16_t *y, int num_threads) {
    float *w = malloc(sizeof(float) * (size_t)T * k);
    for (int t = 0; t < T; t++) {
        float *p = probs + (long)t * E, mx = -INFINITY, z = 0.f, sum = 0.f;
        for (int e = 0; e < E; e++) {
            uint32_t u = (uint32_t)logits[(long)t * E + e] << 16;
            memcpy(p + e, &u, 4);
            mx = p[e] > mx ? p[e] : mx;
        }
        for (int e = 0; e < E; e++) { p[e] = expf(p[e] - mx); z += p[e]; }
        for (int e = 0; e < E; e++) p[e] /= z;
        int64_t *id = ids + (long)t * k;
        for (int j = 0; j < k; j++) {   /* k passes of selection: k is small */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            sum += p[best];
        }
        for (int j = 0; j < k; j++) {
            float v = norm ? p[id[j]] / sum : p[id[j]];
            uint32_t u; memcpy(&u, &v, 4); u += 0x7FFFu + ((u >> 16) & 1u); u &= 0xFFFF0000u;
            memcpy(w + (long)t * k + j, &u, 4);
        }
    }
    (void)moe_experts_bf16(x, T, ids, w, k, gate_up, down, E, D, I, y, num_threads);   /* ids valid by construction */
    free(w);
}
#else
int moe_experts_bf16_available(void) { return 0; }
#endif
