/* Fused bfloat16 layer ops for the CPU engine (inference only), each equal to the PyTorch
   expression it replaces (arbor/models/layers.py) up to the order of one float32 sum:

   rms_norm:      y = w · bf16(x · r),  r = 1 / sqrt(mean(x²) + eps)       (x in float32)
   qk_norm_rope:  per head of q (weight wq) and k (weight wk): y = rms_norm(x), then the first R
                  channels rotate:  y' = bf16(bf16(y · cos) + bf16(rotate_half(y) · sin)),
                  rotate_half(y) = (−y[R/2:R], y[:R/2]); channels ≥ R pass.
   Every product and sum rounds to bfloat16 where PyTorch's bfloat16 ops round. Loaded by
   arbor/models/cpu_ops.py. */
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
