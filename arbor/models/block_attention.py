"""Softmax attention on CPU by query blocks: a few large GEMMs per block, exact softmax, recomputed in backward.

PyTorch's CPU flash kernel multiplies small tiles with MKL (AVX2 code on AMD CPUs); measured on an AMD
EPYC (Zen 5, 2 threads), one causal layer of 4 × 512 tokens, 8 query / 4 key-value heads of 128 took 82 ms
forward + backward in float32 (62 ms in bfloat16). Here each query block of ``BLOCK`` positions, with the
g = Hq / Hkv query heads that share a key-value head stacked as its rows (row r ↔ position i0 + r // g),
meets its whole key range [0, e) at once (e: one past the last key any of its rows sees; the block's
position end for causal attention), in float32 (float64 for float64 inputs; autocast off), every (batch row,
key-value head) pair in one ``torch.bmm`` per product:

    forward:  S = (scale·Q) Kᵀ, masked to −∞;  m = max_j S,  P = exp(S − m),  l = Σ_j P,
              O = (P V) / l,  lse = m + log l  (saved, with Q, K, V, O: nothing [T, S] is kept)
    backward: P = exp((scale·Q) Kᵀ − lse);  ∂V += Pᵀ ∂O;  ∂P = ∂O Vᵀ;  Δ = Σ_d ∂O ∘ O;
              ∂S = P ∘ (∂P − Δ);  ∂Q = scale · ∂S K;  ∂K += ∂Sᵀ (scale·Q)

A row that sees no key gives 0 (SDPA gives NaN there). Callers: ``attention.sdpa`` on CPU outside
inference mode (the engine keeps its own kernels).
"""

from __future__ import annotations

import torch

BLOCK = 128


def block_attention(q, k, v, scale: float, mask: torch.Tensor | None = None, causal: bool = False):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] → [B, T, Hq, D] in q's dtype. ``causal``: key j ≤ query i
    (needs T == S); ``mask``: bool [T, S] (True = attend), the same for every batch row and head."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal block attention needs as many queries as keys, got {q.shape[1]} and {k.shape[1]}")
    return BlockAttention.apply(q, k, v, scale, mask, causal)


def _blocks(t: int, s: int, g: int, mask, causal: bool, device):
    """→ [(i0, i1, e, visible [R, e] bool or None when every key of the range is seen)] per query block."""
    out = []
    for i0 in range(0, t, BLOCK):
        i1 = min(t, i0 + BLOCK)
        if causal:
            e = i1
            pos = torch.arange(i0, i1, device=device).repeat_interleave(g)
            visible = pos[:, None] >= torch.arange(e, device=device)[None, :]
        elif mask is not None:
            rows = mask[i0:i1]
            seen = rows.any(0).nonzero()
            e = int(seen[-1]) + 1 if seen.numel() else 0
            visible = rows[:, :e].repeat_interleave(g, 0)
        else:
            e, visible = s, None
        out.append((i0, i1, e, None if visible is None or bool(visible.all()) else visible))
    return out


class BlockAttention(torch.autograd.Function):
    """The module docstring's forward and backward; layouts inside: Q [B, Hkv, T, g, D] (scaled),
    K, V [B, Hkv, S, D], O like Q, lse [B, Hkv, T·g]."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def forward(ctx, q, k, v, scale, mask, causal):
        b, t, hq, d = q.shape
        s, hkv = k.shape[1], k.shape[2]
        g, wide = hq // hkv, torch.promote_types(q.dtype, torch.float32)
        qs = (q.to(wide) * scale).view(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b * hkv, t * g, d)
        kh = k.to(wide).permute(0, 2, 1, 3).reshape(b * hkv, s, d)
        vh = v.to(wide).permute(0, 2, 1, 3).reshape(b * hkv, s, d)
        o = torch.empty_like(qs)
        lse = qs.new_empty(b * hkv, t * g)
        for i0, i1, e, visible in _blocks(t, s, g, mask, causal, q.device):
            r0, r1 = i0 * g, i1 * g
            if e == 0:
                o[:, r0:r1] = 0
                lse[:, r0:r1] = 0
                continue
            p = torch.bmm(qs[:, r0:r1], kh[:, :e].mT)
            if visible is not None:
                p.masked_fill_(~visible, float("-inf"))
            top = p.amax(-1, keepdim=True).clamp_min_(torch.finfo(wide).min)
            total = p.sub_(top).exp_().sum(-1, keepdim=True)
            torch.bmm(p, vh[:, :e], out=o[:, r0:r1])
            o[:, r0:r1].div_(total.clamp_min_(torch.finfo(wide).tiny))
            lse[:, r0:r1] = (top + total.log())[..., 0]
        ctx.save_for_backward(qs, kh, vh, o, lse, mask)
        ctx.scale, ctx.causal, ctx.shape, ctx.dtypes = scale, causal, (b, t, hkv, g, d), (q.dtype, k.dtype, v.dtype)
        return o.view(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hq, d).to(q.dtype)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, dout):
        qs, kh, vh, o, lse, mask = ctx.saved_tensors
        b, t, hkv, g, d = ctx.shape
        s = kh.shape[1]
        do = dout.to(qs.dtype).view(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b * hkv, t * g, d)
        delta = (do * o).sum(-1, keepdim=True)
        dq, dk, dv = torch.empty_like(qs), torch.zeros_like(kh), torch.zeros_like(vh)
        for i0, i1, e, visible in _blocks(t, s, g, mask, ctx.causal, qs.device):
            r0, r1 = i0 * g, i1 * g
            if e == 0:
                dq[:, r0:r1] = 0
                continue
            q_rows, do_rows = qs[:, r0:r1], do[:, r0:r1]
            p = torch.bmm(q_rows, kh[:, :e].mT)
            if visible is not None:
                p.masked_fill_(~visible, float("-inf"))
            p.sub_(lse[:, r0:r1, None]).exp_()
            dv[:, :e].baddbmm_(p.mT, do_rows)
            ds = torch.bmm(do_rows, vh[:, :e].mT).sub_(delta[:, r0:r1]).mul_(p)
            torch.bmm(ds, kh[:, :e], out=dq[:, r0:r1])
            dk[:, :e].baddbmm_(ds.mT, q_rows)
        dq = dq.mul_(ctx.scale).view(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hkv * g, d)
        dk = dk.view(b, hkv, s, d).permute(0, 2, 1, 3)
        dv = dv.view(b, hkv, s, d).permute(0, 2, 1, 3)
        return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), dv.to(ctx.dtypes[2]), None, None, None
