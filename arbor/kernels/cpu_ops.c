/* Fused layer ops for the CPU engine (inference only), each equal to the PyTorch expression it
   replaces (arbor/models/layers.py) up to the order of one float32 sum; bfloat16, and float32
   (suffix _f32, the same formulas without the roundings):

   rms_norm:      y = w · bf16(x · r),  r = 1 / sqrt(mean(x²) + eps)       (x in float32)
   qk_norm_rope:  per head of q (weight wq) and k (weight wk): y = rms_norm(x), then the first R
                  channels rotate:  y' = bf16(bf16(y · cos) + bf16(rotate_half(y) · sin)),
                  rotate_half(y) = (−y[R/2:R], y[:R/2]); channels ≥ R pass.
   rope:          qk_norm_rope without the norm (models without q/k norm: Llama, Qwen2, Mistral).
   silu_mul:      y = bf16(bf16(silu(g)) · u),  silu(g) = g / (1 + e^−g)   (SwiGLU's product)
   Every product and sum rounds to bfloat16 where PyTorch's bfloat16 ops round. Loaded by
   arbor/kernels/cpu_ops.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;
static inline float f(bf16 h) { uint32_t u = (uint32_t)h << 16; float x; memcpy(&x, &u, 4); return x; }
static inline bf16 b(float x) { uint32_t u; memcpy(&u, &x, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (bf16)(u >> 16); }

/* one row of D: y[i] = bf16(w[i] · bf16(x[i] · r)) as floats */
static inline void norm_row(const bf16 *x, const bf16 *w, int D, float eps, float *y) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < D; i++) { float v = f(x[i]); ss += v * v; }
    const float r = 1.f / sqrtf(ss / D + eps);
    for (int i = 0; i < D; i++) y[i] = f(b(f(w[i]) * f(b(f(x[i]) * r))));
}

/* x: rows of D, `rows` of them, row i at x + i · stride; out: contiguous [rows, D] */
void rms_norm(const bf16 *x, long stride, const bf16 *w, bf16 *out, long rows, int D, float eps) {
    float y[D];
    for (long t = 0; t < rows; t++) {
        norm_row(x + t * stride, w, D, eps, y);
        for (int i = 0; i < D; i++) out[t * D + i] = b(y[i]);
    }
}

static inline void rope_row(const float *y, const bf16 *cos, const bf16 *sin, int D, int R, bf16 *out) {
    const int h = R / 2;
    for (int i = 0; i < R; i++) {
        float rot = i < h ? -y[i + h] : y[i - h];
        out[i] = b(f(b(y[i] * f(cos[i]))) + f(b(rot * f(sin[i]))));
    }
    for (int i = R; i < D; i++) out[i] = b(y[i]);
}

/* q [T, Hq, D] (token stride q_stride, heads D apart), k [T, Hk, D] (k_stride); cos/sin [T, R]
   contiguous → out [T, Hq + Hk, D] contiguous: q heads, then k heads, normed and rotated. */
void qk_norm_rope(const bf16 *q, long q_stride, const bf16 *k, long k_stride, const bf16 *wq, const bf16 *wk,
                  const bf16 *cos, const bf16 *sin, bf16 *out, long T, int Hq, int Hk, int D, int R, float eps) {
    float y[D];
    for (long t = 0; t < T; t++) {
        const bf16 *c = cos + t * R, *s = sin + t * R;
        for (int j = 0; j < Hq + Hk; j++) {
            const bf16 *x = j < Hq ? q + t * q_stride + (long)j * D : k + t * k_stride + (long)(j - Hq) * D;
            norm_row(x, j < Hq ? wq : wk, D, eps, y);
            rope_row(y, c, s, D, R, out + (t * (Hq + Hk) + j) * D);
        }
    }
}

/* qk_norm_rope's layout, RoPE only: out [T, Hq + Hk, D] = rotated q heads, then rotated k heads. */
void rope(const bf16 *q, long q_stride, const bf16 *k, long k_stride, const bf16 *cos, const bf16 *sin, bf16 *out,
          long T, int Hq, int Hk, int D, int R) {
    float y[D];
    for (long t = 0; t < T; t++)
        for (int j = 0; j < Hq + Hk; j++) {
            const bf16 *x = j < Hq ? q + t * q_stride + (long)j * D : k + t * k_stride + (long)(j - Hq) * D;
            for (int i = 0; i < D; i++) y[i] = f(x[i]);
            rope_row(y, cos + t * R, sin + t * R, D, R, out + (t * (Hq + Hk) + j) * D);
        }
}

/* e^x for x in float32 within ~1 ulp (Cephes' expf: x = n·ln2 + r, |r| ≤ ln2/2, a degree-7 polynomial
   for e^r, 2^n from the exponent bits), written to vectorise; x is clamped to e^x's normal range. */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;                     /* not fminf/floorf: those keep gcc from vectorising */
    x = x > 88.3f ? 88.3f : x;
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;   /* round to nearest (1.5 · 2²³) */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { uint32_t u; float f; } scale = { .u = (uint32_t)((int32_t)n + 127) << 23 };
    return p * scale.f;
}

/* g, u: rows of I (row t at g + t · g_stride, u + t · u_stride) → out contiguous [rows, I] */
void silu_mul(const bf16 *restrict g, long g_stride, const bf16 *restrict u, long u_stride, bf16 *restrict out, long rows,
              int I) {
    for (long t = 0; t < rows; t++) {
        const bf16 *gt = g + t * g_stride, *ut = u + t * u_stride;
        bf16 *o = out + t * I;
        #pragma omp simd
        for (int i = 0; i < I; i++) { float x = f(gt[i]); o[i] = b(f(b(x / (1.f + exp_f32(-x)))) * f(ut[i])); }
    }
}

/* ---- float32: the same ops, no roundings between steps ---- */

static inline void norm_row_f32(const float *x, const float *w, int D, float eps, float *y) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < D; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / D + eps);
    #pragma omp simd
    for (int i = 0; i < D; i++) y[i] = w[i] * (x[i] * r);
}

/* x: rows of D, row i at x + i · stride; out: contiguous [rows, D] */
void rms_norm_f32(const float *x, long stride, const float *w, float *out, long rows, int D, float eps) {
    for (long t = 0; t < rows; t++) norm_row_f32(x + t * stride, w, D, eps, out + t * D);
}

void qk_norm_rope_f32(const float *q, long q_stride, const float *k, long k_stride, const float *wq, const float *wk,
                      const float *cos, const float *sin, float *out, long T, int Hq, int Hk, int D, int R, float eps) {
    float y[D];
    const int h = R / 2;
    for (long t = 0; t < T; t++) {
        const float *c = cos + t * R, *s = sin + t * R;
        for (int j = 0; j < Hq + Hk; j++) {
            const float *x = j < Hq ? q + t * q_stride + (long)j * D : k + t * k_stride + (long)(j - Hq) * D;
            float *o = out + (t * (Hq + Hk) + j) * D;
            norm_row_f32(x, j < Hq ? wq : wk, D, eps, y);
            #pragma omp simd
            for (int i = 0; i < h; i++) o[i] = y[i] * c[i] - y[i + h] * s[i];
            #pragma omp simd
            for (int i = h; i < R; i++) o[i] = y[i] * c[i] + y[i - h] * s[i];
            for (int i = R; i < D; i++) o[i] = y[i];
        }
    }
}

static inline void rope_row_f32(const float *y, const float *c, const float *s, int D, int R, float *o) {
    const int h = R / 2;
    #pragma omp simd
    for (int i = 0; i < h; i++) o[i] = y[i] * c[i] - y[i + h] * s[i];
    #pragma omp simd
    for (int i = h; i < R; i++) o[i] = y[i] * c[i] + y[i - h] * s[i];
    for (int i = R; i < D; i++) o[i] = y[i];
}

void rope_f32(const float *q, long q_stride, const float *k, long k_stride, const float *cos, const float *sin,
              float *out, long T, int Hq, int Hk, int D, int R) {
    for (long t = 0; t < T; t++)
        for (int j = 0; j < Hq + Hk; j++)
            rope_row_f32(j < Hq ? q + t * q_stride + (long)j * D : k + t * k_stride + (long)(j - Hq) * D,
                         cos + t * R, sin + t * R, D, R, out + (t * (Hq + Hk) + j) * D);
}

void silu_mul_f32(const float *restrict g, long g_stride, const float *restrict u, long u_stride, float *restrict out,
                  long rows, int I) {
    for (long t = 0; t < rows; t++) {
        const float *gt = g + t * g_stride, *ut = u + t * u_stride;
        float *o = out + t * I;
        #pragma omp simd
        for (int i = 0; i < I; i++) o[i] = gt[i] / (1.f + exp_f32(-gt[i])) * ut[i];
    }
}
