/* Fused element-wise ops of the trainer, forward and backward, over rows split between threads (loaded by
   arbor/kernels/train_ops.py), built twice: for bfloat16 tensors (elem = bf16) and, with -DARBOR_TRAIN_F32, for
   float32 ones (elem = float; bf16(·) below is then the identity). Every value is float32 between an elem load
   and an elem store; the bf16 forwards round where PyTorch's bfloat16 expressions round (arbor/models/layers.py,
   moe.py). Block attention's steps: softmax_rows in both builds; exp_rows and scaled_product for bf16;
   shifted_exp_rows and softmax_grad_rows (plain float32, taken from the float32 build) for float32.

   rms_norm_fwd:  r = 1 / sqrt(mean(x²) + eps),  x̂ = x · r,  y = bf16(w · bf16(x̂))         (saves r)
   rms_norm_bwd:  ĝ = g · w,  dx = r · (ĝ − x̂ · mean(ĝ ∘ x̂)),  dw = Σ_rows g · bf16(x̂)
   qk_norm_rope_fwd: per head of [T, Hq + Hk, D] (q heads with weight wq, then k heads with wk): y = rms_norm(x),
                  then the first R channels rotate: y' = bf16(bf16(y · cos) + bf16(rotate_half(y) · sin)),
                  rotate_half(y) = (−y[R/2:R], y[:R/2]); channels ≥ R pass                 (saves r per head)
   qk_norm_rope_bwd: ∂y_i = g_i cos_i + (i < R/2 ? g_{i+R/2} sin_{i+R/2} : −g_{i−R/2} sin_{i−R/2}) (i < R;
                  ∂y_i = g_i beyond), then rms_norm_bwd's formulas per head
   softmax_rows:  per row of S (float32, masked columns −∞): m = max, l = Σ exp(S − m),
                  P̂ = bf16(exp(S − m) / l), lse = m + log l (0 and P̂ = 0 for a row that sees nothing)
                                                                                  (block attention's forward)
   exp_rows:      P = exp(scale · X) from bf16 X, masked columns 0; writes P and bf16(P)   (its backward)
   scaled_product: out = bf16(scale · P ∘ D), P float32, D bf16                       (its ∂S)
   shifted_exp_rows: S = exp(S − shift_row) in place, float32, masked columns 0     (the float32 backward's P)
   softmax_grad_rows: D = P ∘ (D − δ_row) in place, float32                          (the float32 backward's ∂S)
   sum_rows:      out[t] = bf16(Σ_j src[pos[t, j]]) (k rows per t, float32 sum)   (MoE: a token's expert outputs)
   Attention rows: N · R rows of e columns; columns [c, e) of row r are masked where visible[r, j − c] is 0
   (visible: uint8 [R, e − c], the same for every n; NULL: none masked).
   swiglu_fwd:    a = bf16(bf16(silu(h_g)) · h_u),  out = bf16(a · c)  (c: the row's weight, or 1)
   swiglu_bwd:    given da (∂ of the weighted a): dc = Σ_I da · a,  t = da · c,
                  dh_g = t · h_u · σ(h_g) (1 + h_g (1 − σ(h_g))),  dh_u = t · silu(h_g); also writes
                  swiglu_fwd's out where asked (the backward's own ∂ of the down projection needs it)     */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#ifdef ARBOR_TRAIN_F32                     /* the float32 build: loads and stores are plain */
typedef float elem;
static inline float f(elem h) { return h; }
static inline elem b(float x) { return x; }
#else                                     /* the bfloat16 build */
typedef uint16_t elem;
static inline float f(elem h) { uint32_t u = (uint32_t)h << 16; float x; memcpy(&x, &u, 4); return x; }
static inline elem b(float x) {                        /* round to nearest even */
    uint32_t u; memcpy(&u, &x, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (elem)(u >> 16);
}
#endif

/* e^x in float32 within ~1 ulp (as cpu_ops.c's exp_f32), clamped to e^x's normal range */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
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

/* x, y: contiguous [rows, D]; w [D]; rstd [rows] */
void rms_norm_fwd(const elem *restrict x, const elem *restrict w, elem *restrict y, float *restrict rstd, long rows,
                  int D, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < rows; t++) {
        const elem *xt = x + t * D;
        elem *yt = y + t * D;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < D; i++) { float v = f(xt[i]); ss += v * v; }
        const float r = 1.f / sqrtf(ss / D + eps);
        rstd[t] = r;
        #pragma omp simd
        for (int i = 0; i < D; i++) yt[i] = b(f(w[i]) * f(b(f(xt[i]) * r)));
    }
}

/* g, dx: contiguous [rows, D]; dw_parts: float32 [threads, D], zeroed, summed by the caller */
void rms_norm_bwd(const elem *restrict x, const elem *restrict w, const float *restrict rstd, const elem *restrict g,
                  elem *restrict dx, float *restrict dw_parts, long rows, int D, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        float *restrict dw = dw_parts + (long)omp_get_thread_num() * D;
        #pragma omp for schedule(static)
        for (long t = 0; t < rows; t++) {
            const elem *xt = x + t * D, *gt = g + t * D;
            elem *dxt = dx + t * D;
            const float r = rstd[t];
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int i = 0; i < D; i++) dot += f(gt[i]) * f(w[i]) * (f(xt[i]) * r);
            const float m = dot / D;
            #pragma omp simd
            for (int i = 0; i < D; i++) {
                const float xh = f(xt[i]) * r, gi = f(gt[i]);
                dxt[i] = b(r * (gi * f(w[i]) - xh * m));
                dw[i] += gi * f(b(xh));
            }
        }
    }
}

/* x, y: contiguous [T, H, D], heads [0, Hq) normed by wq, [Hq, H) by wk; cos, sin [T, R]; rstd [T, H] */
void qk_norm_rope_fwd(const elem *restrict x, const elem *restrict wq, const elem *restrict wk,
                      const elem *restrict cos, const elem *restrict sin, elem *restrict y, float *restrict rstd,
                      long T, int H, int Hq, int D, int R, float eps, int threads) {
    const int h = R / 2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < T; t++) {
        const elem *c = cos + t * R, *s = sin + t * R;
        float n[D];
        for (int j = 0; j < H; j++) {
            const elem *xr = x + (t * H + j) * D, *w = j < Hq ? wq : wk;
            elem *yr = y + (t * H + j) * D;
            float ss = 0.f;
            #pragma omp simd reduction(+:ss)
            for (int i = 0; i < D; i++) { float v = f(xr[i]); ss += v * v; }
            const float r = 1.f / sqrtf(ss / D + eps);
            rstd[t * H + j] = r;
            #pragma omp simd
            for (int i = 0; i < D; i++) n[i] = f(b(f(w[i]) * f(b(f(xr[i]) * r))));
            #pragma omp simd
            for (int i = 0; i < h; i++) yr[i] = b(f(b(n[i] * f(c[i]))) + f(b(-n[i + h] * f(s[i]))));
            #pragma omp simd
            for (int i = h; i < R; i++) yr[i] = b(f(b(n[i] * f(c[i]))) + f(b(n[i - h] * f(s[i]))));
            for (int i = R; i < D; i++) yr[i] = b(n[i]);
        }
    }
}

/* g, dx: contiguous [T, H, D]; dw_parts: float32 [threads, 2, D] (wq's, then wk's), zeroed, summed by the caller */
void qk_norm_rope_bwd(const elem *restrict x, const elem *restrict wq, const elem *restrict wk,
                      const elem *restrict cos, const elem *restrict sin, const float *restrict rstd,
                      const elem *restrict g, elem *restrict dx, float *restrict dw_parts, long T, int H, int Hq, int D,
                      int R, int threads) {
    const int h = R / 2;
    #pragma omp parallel num_threads(threads)
    {
        float *restrict dws = dw_parts + (long)omp_get_thread_num() * 2 * D;
        float dy[D];
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            const elem *c = cos + t * R, *s = sin + t * R;
            for (int j = 0; j < H; j++) {
                const elem *xr = x + (t * H + j) * D, *gr = g + (t * H + j) * D, *w = j < Hq ? wq : wk;
                float *restrict dw = dws + (j < Hq ? 0 : D);
                elem *dxr = dx + (t * H + j) * D;
                const float r = rstd[t * H + j];
                #pragma omp simd
                for (int i = 0; i < h; i++) dy[i] = f(gr[i]) * f(c[i]) + f(gr[i + h]) * f(s[i + h]);
                #pragma omp simd
                for (int i = h; i < R; i++) dy[i] = f(gr[i]) * f(c[i]) - f(gr[i - h]) * f(s[i - h]);
                for (int i = R; i < D; i++) dy[i] = f(gr[i]);
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int i = 0; i < D; i++) dot += dy[i] * f(w[i]) * (f(xr[i]) * r);
                const float m = dot / D;
                #pragma omp simd
                for (int i = 0; i < D; i++) {
                    const float xh = f(xr[i]) * r;
                    dxr[i] = b(r * (dy[i] * f(w[i]) - xh * m));
                    dw[i] += dy[i] * f(b(xh));
                }
            }
        }
    }
}

void softmax_rows(float *restrict s, long N, int R, int e, int c, const uint8_t *restrict visible,
                  elem *restrict probs, float *restrict lse, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long row = 0; row < N * R; row++) {
        float *x = s + row * e;
        elem *o = probs + row * e;
        if (visible) {
            const uint8_t *v = visible + (row % R) * (e - c);
            #pragma omp simd
            for (int j = c; j < e; j++) x[j] = v[j - c] ? x[j] : -INFINITY;
        }
        float m = -INFINITY;
        #pragma omp simd reduction(max:m)
        for (int j = 0; j < e; j++) m = x[j] > m ? x[j] : m;
        if (m == -INFINITY) {
            memset(o, 0, (size_t)e * sizeof(elem));
            lse[row] = 0.f;
            continue;
        }
        float sum = 0.f;
        #pragma omp simd reduction(+:sum)
        for (int j = 0; j < e; j++) { x[j] = x[j] == -INFINITY ? 0.f : exp_f32(x[j] - m); sum += x[j]; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int j = 0; j < e; j++) o[j] = b(x[j] * inv);
        lse[row] = m + logf(sum);
    }
}

void exp_rows(const elem *restrict x, long N, int R, int e, int c, const uint8_t *restrict visible, float scale,
              float *restrict p, elem *restrict pb, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long row = 0; row < N * R; row++) {
        const elem *xr = x + row * e;
        float *pr = p + row * e;
        elem *br = pb + row * e;
        #pragma omp simd
        for (int j = 0; j < e; j++) { pr[j] = exp_f32(scale * f(xr[j])); br[j] = b(pr[j]); }
        if (visible) {
            const uint8_t *v = visible + (row % R) * (e - c);
            #pragma omp simd
            for (int j = c; j < e; j++) { pr[j] = v[j - c] ? pr[j] : 0.f; br[j] = v[j - c] ? br[j] : 0; }
        }
    }
}

void scaled_product(const float *restrict p, const elem *restrict d, float scale, elem *restrict out, long n,
                    int threads) {
    #pragma omp parallel for simd num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) out[i] = b(scale * p[i] * f(d[i]));
}

void shifted_exp_rows(float *restrict s, long N, int R, int e, int c, const uint8_t *restrict visible,
                      const float *restrict shift, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long row = 0; row < N * R; row++) {
        float *x = s + row * e;
        const float m = shift[row];
        #pragma omp simd
        for (int j = 0; j < e; j++) x[j] = exp_f32(x[j] - m);
        if (visible) {
            const uint8_t *v = visible + (row % R) * (e - c);
            #pragma omp simd
            for (int j = c; j < e; j++) x[j] = v[j - c] ? x[j] : 0.f;
        }
    }
}

void softmax_grad_rows(const float *restrict p, float *restrict d, const float *restrict delta, long rows, int e,
                       int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long row = 0; row < rows; row++) {
        const float *pr = p + row * e;
        float *dr = d + row * e;
        const float dl = delta[row];
        #pragma omp simd
        for (int j = 0; j < e; j++) dr[j] = pr[j] * (dr[j] - dl);
    }
}

/* h: [rows, 2I] (gate | up, row stride 2I); c: [rows] or NULL; out: contiguous [rows, I] */
void swiglu_fwd(const elem *restrict h, const elem *restrict c, elem *restrict out, long rows, int I, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < rows; t++) {
        const elem *g = h + t * 2 * I, *u = g + I;
        elem *o = out + t * I;
        const float ct = c ? f(c[t]) : 1.f;
        #pragma omp simd
        for (int i = 0; i < I; i++) {
            const float x = f(g[i]);
            const float a = f(b(f(b(x * (1.f / (1.f + exp_f32(-x))))) * f(u[i])));   /* silu as swiglu_bwd's */
            o[i] = b(a * ct);                         /* a is an elem value: × 1 (no weight) is exact */
        }
    }
}

/* one row of swiglu_bwd; `store` (a constant where inlined) writes the forward's output to o */
static inline float swiglu_bwd_row(const elem *restrict g, const elem *restrict u, const elem *restrict dat, float ct,
                                   elem *restrict dg, elem *restrict du, elem *restrict o, int I, const int store) {
    float dot = 0.f;
    #pragma omp simd reduction(+:dot)
    for (int i = 0; i < I; i++) {
        const float x = f(g[i]), s = 1.f / (1.f + exp_f32(-x)), silu = x * s, ui = f(u[i]);
        const float d = f(dat[i]), tt = d * ct, a = f(b(f(b(silu)) * ui));
        dot += d * a;
        if (store) o[i] = b(a * ct);                 /* a is an elem value: × 1 (no weight) is exact */
        dg[i] = b(tt * ui * s * (1.f + x * (1.f - s)));
        du[i] = b(tt * silu);
    }
    return dot;
}

/* h as above; da: contiguous [rows, I]; c, dc: [rows] or NULL; dh: contiguous [rows, 2I]; out: [rows, I] or NULL */
void swiglu_bwd(const elem *restrict h, const elem *restrict c, const elem *restrict da, elem *restrict dh,
                float *restrict dc, elem *restrict out, long rows, int I, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < rows; t++) {
        const elem *g = h + t * 2 * I;
        elem *dg = dh + t * 2 * I;
        const float ct = c ? f(c[t]) : 1.f;
        const float dot = out ? swiglu_bwd_row(g, g + I, da + t * I, ct, dg, dg + I, out + t * I, I, 1)
                              : swiglu_bwd_row(g, g + I, da + t * I, ct, dg, dg + I, NULL, I, 0);
        if (dc) dc[t] = dot;
    }
}

/* src [*, D] contiguous; pos [T, k] row indices into src; out contiguous [T, D] */
void sum_rows(const elem *restrict src, const int64_t *restrict pos, elem *restrict out, long T, int k, int D,
              int threads) {
    #pragma omp parallel num_threads(threads)
    {
        float acc[D];
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            #pragma omp simd
            for (int i = 0; i < D; i++) acc[i] = 0.f;
            for (int j = 0; j < k; j++) {
                const elem *r = src + pos[t * k + j] * D;
                #pragma omp simd
                for (int i = 0; i < D; i++) acc[i] += f(r[i]);
            }
            #pragma omp simd
            for (int i = 0; i < D; i++) out[t * D + i] = b(acc[i]);
        }
    }
}
