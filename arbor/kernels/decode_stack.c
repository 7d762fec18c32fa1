/* A whole decode step of a dense softmax-attention model (Qwen3's layer: q/k RMSNorm per head, RoPE, GQA,
   SwiGLU; or Llama's, Qwen2's, Mistral's: no q/k norm) in one call from Python: the layers' ops in the order
   the PyTorch modules run them, each by the same C function the module would call (function pointers passed
   in: cpu_ops.c's rms_norm / qk_norm_rope / rope / silu_mul, small_linear.c's few-row linear, paged_decode.c's
   attention), so the hidden states equal the module path's bit for bit. What is left between those calls is
   exact: KV rows copied into their slots and the residual adds (float32, or bfloat16 = round-to-nearest-even
   of the float32 sum, as PyTorch's add).

   Per layer l, rows t < T (one query token each):
       h = rms_norm(x, in_norm);  [q | k | v] = h Wqkvᵀ + b
       q, k = rope(rms_norm_head(q, q_norm)), rope(rms_norm_head(k, k_norm))   (no norm without q/k norms)
       K[slot_t], V[slot_t] = k, v
       x = x + (attn(q; K, V) Woᵀ + b);  h = rms_norm(x, post_norm)
       x = x + (silu(h Wgᵀ) · (h Wuᵀ)) Wdᵀ + b
   out = rms_norm(x, final_norm). Built by arbor/kernels/native.py, loaded by arbor/engine/decode_stack.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*norm_fn)(const void *x, long stride, const void *w, void *out, long rows, int D, float eps);
typedef int (*linear_fn)(const void *x, int M, int K, const void *w, const void *bias, int N, void *y, int threads);
typedef void (*qk_fn)(const void *q, long q_stride, const void *k, long k_stride, const void *wq, const void *wk,
                      const void *cos, const void *sin, void *out, long T, int hq, int hk, int D, int R, float eps);
typedef void (*attn_fn)(const void *q, long q_stride, const void *k_cache, const void *v_cache, void *out, int bf16,
                        const int32_t *tables, int width, const int32_t *ctx, int B, int H, int Hkv, int D, int bs,
                        float scale, int threads);
typedef void (*silu_fn)(const void *g, long g_stride, const void *u, long u_stride, void *out, long rows, int I);
typedef void (*rope_fn)(const void *q, long q_stride, const void *k, long k_stride, const void *cos, const void *sin,
                        void *out, long T, int hq, int hk, int D, int R);

/* The functions, in this order in `fns`. */
enum { RMS_NORM, LINEAR, QK_NORM_ROPE, ATTENTION, SILU_MUL, ROPE, NUM_FNS };
/* Per layer, in this order in `layers` (one row of LAYER_PTRS pointers per layer; biases may be 0, and the
   q/k norms: a model without them, Llama, Qwen2, Mistral, is rotated by ROPE alone). */
enum { IN_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, K_CACHE, V_CACHE, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS,
       DOWN, DOWN_BIAS, LAYER_PTRS };

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}

static void add_into(void *x, const void *h, long n, int bf16) {
    if (bf16) {
        uint16_t *a = x; const uint16_t *b = h;
        for (long i = 0; i < n; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    } else {
        float *a = x; const float *b = h;
        #pragma omp simd
        for (long i = 0; i < n; i++) a[i] += b[i];
    }
}

/* x [T, H] (the embeddings; overwritten with the residual stream), out [T, H]; slots [T] int64; tables
   [T, width] int32, ctx [T] int32 (the attention kernel's); cos/sin [T, R]. dims: H, hq, hk, D, R, I,
   block_size, bf16, num_layers (the model's), width, threads (the step's). → 0, or −1 when out of memory. */
int decode_stack(const int64_t *fns, const int64_t *layers, const void *final_norm, void *x, void *out, int T,
                 const int64_t *slots, const int32_t *tables, const int32_t *ctx, const void *cos, const void *sin,
                 const int32_t *dims, float eps, float scale) {
    const int H = dims[0], hq = dims[1], hk = dims[2], D = dims[3], R = dims[4], I = dims[5], bs = dims[6];
    const int bf16 = dims[7], L = dims[8], width = dims[9], nt = dims[10];
    const norm_fn norm = (norm_fn)fns[RMS_NORM];
    const linear_fn linear = (linear_fn)fns[LINEAR];
    const qk_fn qk = (qk_fn)fns[QK_NORM_ROPE];
    const attn_fn attn = (attn_fn)fns[ATTENTION];
    const silu_fn silu = (silu_fn)fns[SILU_MUL];
    const rope_fn rope = (rope_fn)fns[ROPE];
    const long es = bf16 ? 2 : 4, nqkv = (long)(hq + 2 * hk) * D, wide = nqkv > 2L * I ? nqkv : 2L * I;
    char *h = malloc((size_t)T * H * es), *big = malloc((size_t)T * wide * es);
    const long narrow = (long)hq * D > I ? (long)hq * D : I;     /* the attention's output, then silu · up */
    char *qk_out = malloc((size_t)T * (hq + hk) * D * es), *att = malloc((size_t)T * narrow * es);
    int bad = !h || !big || !qk_out || !att;
    for (int l = 0; l < L && !bad; l++) {
        const int64_t *p = layers + (long)l * LAYER_PTRS;
        char *kc = (char *)p[K_CACHE], *vc = (char *)p[V_CACHE];
        norm(x, H, (void *)p[IN_NORM], h, T, H, eps);
        bad |= linear(h, T, H, (void *)p[QKV], (void *)p[QKV_BIAS], (int)nqkv, big, nt);
        if (p[Q_NORM])
            qk(big, nqkv, big + (long)hq * D * es, nqkv, (void *)p[Q_NORM], (void *)p[K_NORM], cos, sin, qk_out, T, hq,
               hk, D, R, eps);
        else
            rope(big, nqkv, big + (long)hq * D * es, nqkv, cos, sin, qk_out, T, hq, hk, D, R);
        for (int t = 0; t < T; t++) {
            memcpy(kc + slots[t] * hk * D * es, qk_out + ((long)t * (hq + hk) + hq) * D * es, (size_t)hk * D * es);
            memcpy(vc + slots[t] * hk * D * es, big + ((long)t * nqkv + (long)(hq + hk) * D) * es, (size_t)hk * D * es);
        }
        attn(qk_out, (long)(hq + hk) * D, kc, vc, att, bf16, tables, width, ctx, T, hq, hk, D, bs, scale, nt);
        bad |= linear(att, T, hq * D, (void *)p[O], (void *)p[O_BIAS], H, h, nt);
        add_into(x, h, (long)T * H, bf16);
        norm(x, H, (void *)p[POST_NORM], h, T, H, eps);
        bad |= linear(h, T, H, (void *)p[GATE_UP], (void *)p[GATE_UP_BIAS], 2 * I, big, nt);
        silu(big, 2L * I, big + (long)I * es, 2L * I, att, T, I);
        bad |= linear(att, T, I, (void *)p[DOWN], (void *)p[DOWN_BIAS], H, h, nt);
        add_into(x, h, (long)T * H, bf16);
    }
    if (!bad) norm(x, H, final_norm, out, T, H, eps);
    free(h); free(big); free(qk_out); free(att);
    return bad ? -1 : 0;
}
