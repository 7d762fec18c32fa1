"""Softmax attention on CPU by query blocks: a few large GEMMs per block, exact softmax, recomputed in backward.

PyTorch's CPU flash kernel multiplies small tiles; here each query block of ``BLOCK`` positions, with the
g = Hq / Hkv query heads that share a key-value head stacked as its rows (row r ↔ position i0 + r // g),
meets its whole key range [0, e) at once (e: one past the last key any of its rows sees; the block's
position end for causal attention), every (batch row, key-value head) pair in one ``torch.bmm`` per
product; only the key columns some row of the block does not see (for causal attention, the block's own
diagonal square) are masked. float32 / float16 inputs are attended in float32 (float64 in float64;
autocast off):

    forward:  S = (scale·Q) Kᵀ, masked to −∞;  m = max_j S,  P = exp(S − m),  l = Σ_j P,
              O = (P V) / l,  lse = m + log l  (saved, with Q, K, V, O: nothing [T, S] is kept)
    backward: P = exp((scale·Q) Kᵀ − lse);  ∂V += Pᵀ ∂O;  ∂P = ∂O Vᵀ;  Δ = Σ_d ∂O ∘ O;
              ∂S = P ∘ (∂P − Δ);  ∂Q = scale · ∂S K;  ∂K += ∂Sᵀ (scale·Q)

bfloat16 inputs take bfloat16 GEMMs (oneDNN; float32 sums) where FlashAttention rounds to bfloat16 —
P·V with P/l rounded, ∂V with P rounded, ∂Q and ∂K with scale·∂S rounded — and keep S = (scale·Q) Kᵀ
of the forward in float32. The backward's two other products, whose float32 results a bfloat16 GEMM
would round, take their row shift inside the GEMM, so the rounding is relative to the shifted value:
with c = lse / scale and Δ each split into bfloat16 hi + lo,

    [Q, −c_hi, −c_lo] [K, 1, 1]ᵀ = S/scale − c,   [∂O, −Δ_hi, −Δ_lo] [V, 1, 1]ᵀ = ∂P − Δ,

so P = exp(scale · (S/scale − c)) has relative error ≤ 2⁻⁹·|log P| (P·|log P| ≤ 1/e: below the
bfloat16 rounding of P that FlashAttention applies) and ∂P − Δ is rounded once, like ∂S after it. ∂K
and ∂V sum their query blocks' bfloat16 products in float32. The element-wise steps between the GEMMs
(masking, softmax, exp, scale · P ∘ (∂P − Δ)) run as one pass each in ``train_ops`` where it is built; in
float32 too (softmax → P / l, so O = (P / l) V; exp(S − lse); P ∘ (∂P − Δ)).

A row that sees no key gives 0 (SDPA gives NaN there) and saves lse = 0. Callers: ``attention.sdpa`` on
CPU outside inference mode (the engine keeps its own kernels).
"""

from __future__ import annotations

import torch

from arbor.kernels import train_ops

BLOCK = 128


def block_attention(q, k, v, scale: float, mask: torch.Tensor | None = None, causal: bool = False):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] → [B, T, Hq, D] in q's dtype. ``causal``: key j ≤ query i
    (needs T == S); ``mask``: bool [T, S] (True = attend), the same for every batch row and head."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal block attention needs as many queries as keys, got {q.shape[1]} and {k.shape[1]}")
    if q.dtype == k.dtype == v.dtype == torch.bfloat16:
        return Bf16BlockAttention.apply(q, k, v, scale, mask, causal)
    return BlockAttention.apply(q, k, v, scale, mask, causal)


def _blocks(t: int, s: int, g: int, mask, causal: bool, device):
    """→ [(i0, i1, e, c, visible)] per query block: key range [0, e), columns [0, c) seen by every row,
    ``visible`` [R, e − c] bool for columns [c, e) (None when c == e)."""
    out = []
    for i0 in range(0, t, BLOCK):
        i1 = min(t, i0 + BLOCK)
        if causal:
            e = c = i1
            pos = torch.arange(i0, i1, device=device).repeat_interleave(g)
            visible = pos[:, None] >= torch.arange(e, device=device)[None, :]
        elif mask is not None:
            rows = mask[i0:i1]
            seen = rows.any(0).nonzero()
            e = int(seen[-1]) + 1 if seen.numel() else 0
            visible = rows[:, :e].repeat_interleave(g, 0)
        else:
            e = c = s
            visible = None
        if visible is not None:
            partial = (~visible.all(0)).nonzero()
            c = int(partial[0]) if partial.numel() else e
            visible = visible[:, c:] if c < e else None
        out.append((i0, i1, e, c, visible))
    return out


def _heads(x: torch.Tensor, b: int, t: int, hkv: int, g: int, d: int) -> torch.Tensor:
    """[B, T, Hkv·g, D] → [B·Hkv, T·g, D] (query heads of one key-value head stacked as rows)."""
    return x.reshape(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b * hkv, t * g, d)


def _unheads(x: torch.Tensor, b: int, t: int, hkv: int, g: int, d: int) -> torch.Tensor:
    return x.view(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hkv * g, d)


def _softmax_rows(p: torch.Tensor, c: int, visible, wide: torch.dtype):
    """Masks p's unseen columns, turns each row into exp(p − m) in place → (m, l = Σ exp) [.., R, 1];
    a row that sees nothing gets p = 0 and l = 0."""
    if visible is not None:
        p[..., c:].masked_fill_(~visible, float("-inf"))
    top = p.amax(-1, keepdim=True).clamp_min_(torch.finfo(wide).min)
    return top, p.sub_(top).exp_().sum(-1, keepdim=True)


def _lse(top: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """m + log l per row; 0 for a row that sees no key (l = 0)."""
    return torch.where(total > 0, top + total.log(), 0.0)[..., 0]


class BlockAttention(torch.autograd.Function):
    """The module docstring's forward and backward in float32 (float64); layouts inside: Q [B, Hkv, T, g, D]
    (scaled), K, V [B, Hkv, S, D], O like Q, lse [B, Hkv, T·g]."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def forward(ctx, q, k, v, scale, mask, causal):
        b, t, hq, d = q.shape
        s, hkv = k.shape[1], k.shape[2]
        g, wide = hq // hkv, torch.promote_types(q.dtype, torch.float32)
        qs = _heads(q.to(wide) * scale, b, t, hkv, g, d)
        kh, vh = (_heads(x.to(wide), b, s, hkv, 1, d) for x in (k, v))
        o = torch.empty_like(qs)
        lse = qs.new_zeros(b * hkv, t * g)
        fused = train_ops.available(qs)               # float32: softmax, exp and ∂S one pass each
        for i0, i1, e, c, visible in _blocks(t, s, g, mask, causal, q.device):
            r0, r1 = i0 * g, i1 * g
            if e == 0:
                o[:, r0:r1] = 0
                continue
            p = torch.bmm(qs[:, r0:r1], kh[:, :e].mT)
            if fused:
                probs, lse[:, r0:r1] = train_ops.softmax_rows(p, c, visible, wide)
                torch.bmm(probs, vh[:, :e], out=o[:, r0:r1])
                continue
            top, total = _softmax_rows(p, c, visible, wide)
            torch.bmm(p, vh[:, :e], out=o[:, r0:r1])
            o[:, r0:r1].div_(total.clamp_min(torch.finfo(wide).tiny))
            lse[:, r0:r1] = _lse(top, total)
        ctx.save_for_backward(qs, kh, vh, o, lse, mask)
        ctx.scale, ctx.causal, ctx.shape, ctx.dtypes = scale, causal, (b, t, hkv, g, d), (q.dtype, k.dtype, v.dtype)
        return _unheads(o, b, t, hkv, g, d).to(q.dtype)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, dout):
        qs, kh, vh, o, lse, mask = ctx.saved_tensors
        b, t, hkv, g, d = ctx.shape
        s = kh.shape[1]
        do = _heads(dout.to(qs.dtype), b, t, hkv, g, d)
        delta = (do * o).sum(-1, keepdim=True)
        dq, dk, dv = torch.empty_like(qs), torch.zeros_like(kh), torch.zeros_like(vh)
        fused = train_ops.available(qs)
        for i0, i1, e, c, visible in _blocks(t, s, g, mask, ctx.causal, qs.device):
            r0, r1 = i0 * g, i1 * g
            if e == 0:
                dq[:, r0:r1] = 0
                continue
            q_rows, do_rows = qs[:, r0:r1], do[:, r0:r1]
            p = torch.bmm(q_rows, kh[:, :e].mT)
            if fused:
                train_ops.shifted_exp_rows(p, lse[:, r0:r1], c, visible)
            else:
                if visible is not None:
                    p[..., c:].masked_fill_(~visible, float("-inf"))
                p.sub_(lse[:, r0:r1, None]).exp_()
            dv[:, :e].baddbmm_(p.mT, do_rows)
            ds = torch.bmm(do_rows, vh[:, :e].mT)
            if fused:
                train_ops.softmax_grad_rows(p, ds, delta[:, r0:r1, 0])
            else:
                ds.sub_(delta[:, r0:r1]).mul_(p)
            torch.bmm(ds, kh[:, :e], out=dq[:, r0:r1])
            dk[:, :e].baddbmm_(ds.mT, q_rows)
        dq = _unheads(dq.mul_(ctx.scale), b, t, hkv, g, d)
        dk, dv = (_unheads(x, b, s, hkv, 1, d) for x in (dk, dv))
        return dq.to(ctx.dtypes[0]), dk.to(ctx.dtypes[1]), dv.to(ctx.dtypes[2]), None, None, None


def _shifted(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x [N, R, D] bfloat16, shift [N, R] float32 → [x, −hi, −lo] [N, R, D + 2] with hi + lo ≈ shift."""
    hi = shift.to(torch.bfloat16)
    lo = (shift - hi.float()).to(torch.bfloat16)
    return torch.cat([x, -hi[..., None], -lo[..., None]], -1)


def _ones(x: torch.Tensor) -> torch.Tensor:
    """x [N, S, D] → [x, 1, 1] [N, S, D + 2] (the other side of ``_shifted``)."""
    return torch.cat([x, x.new_ones(*x.shape[:-1], 2)], -1)


class Bf16BlockAttention(torch.autograd.Function):
    """The module docstring's bfloat16 forward and backward; layouts as in ``BlockAttention`` (Q kept
    unscaled in bfloat16, with a float32 scaled copy for the forward's S only)."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def forward(ctx, q, k, v, scale, mask, causal):
        b, t, hq, d = q.shape
        s, hkv = k.shape[1], k.shape[2]
        g, wide = hq // hkv, torch.float32
        qb = _heads(q, b, t, hkv, g, d)
        kb, vb = (_heads(x, b, s, hkv, 1, d) for x in (k, v))
        qs, k32 = qb.float().mul_(scale), kb.float()
        o = torch.empty_like(qb)
        fused = train_ops.available(qb)
        lse = qs.new_zeros(b * hkv, t * g)
        for i0, i1, e, c, visible in _blocks(t, s, g, mask, causal, q.device):
            r0, r1 = i0 * g, i1 * g
            if e == 0:
                o[:, r0:r1] = 0
                continue
            p = torch.bmm(qs[:, r0:r1], k32[:, :e].mT)
            if fused:
                probs, lse[:, r0:r1] = train_ops.softmax_rows(p, c, visible)
            else:
                top, total = _softmax_rows(p, c, visible, wide)
                probs = torch.mul(p, total.clamp_min(torch.finfo(wide).tiny).reciprocal_(),
                                  out=torch.empty_like(p, dtype=torch.bfloat16))
                lse[:, r0:r1] = _lse(top, total)
            torch.bmm(probs, vb[:, :e], out=o[:, r0:r1])
        ctx.save_for_backward(qb, kb, vb, o, lse, mask)
        ctx.scale, ctx.causal, ctx.shape = scale, causal, (b, t, hkv, g, d)
        return _unheads(o, b, t, hkv, g, d)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, dout):
        qb, kb, vb, o, lse, mask = ctx.saved_tensors
        b, t, hkv, g, d = ctx.shape
        s, scale = kb.shape[1], ctx.scale
        do = _heads(dout.to(torch.bfloat16), b, t, hkv, g, d)
        delta = (do.float() * o.float()).sum(-1)
        qx, kx = _shifted(qb, lse / scale), _ones(kb)
        dox, vx = _shifted(do, delta), _ones(vb)
        dq = torch.empty_like(qb)
        fused = train_ops.available(qb)
        dk, dv = (x.new_zeros(x.shape, dtype=torch.float32) for x in (kb, vb))
        for i0, i1, e, c, visible in _blocks(t, s, g, mask, ctx.causal, qb.device):
            r0, r1 = i0 * g, i1 * g
            if e == 0:
                dq[:, r0:r1] = 0
                continue
            shifted = torch.bmm(qx[:, r0:r1], kx[:, :e].mT)          # S/scale − lse/scale, bf16
            if fused:
                p, rounded = train_ops.exp_rows(shifted, scale, c, visible)
            else:
                if visible is not None:
                    shifted[..., c:].masked_fill_(~visible, float("-inf"))
                p = shifted.float().mul_(scale).exp_()
                rounded = p.to(torch.bfloat16)
            dv[:, :e] += torch.bmm(rounded.mT, do[:, r0:r1])
            dpd = torch.bmm(dox[:, r0:r1], vx[:, :e].mT)               # ∂P − Δ, bf16
            if fused:
                ds = train_ops.scaled_product(p, dpd, scale)           # scale · P ∘ (∂P − Δ)
            else:
                ds = torch.mul(p.mul_(dpd), scale, out=torch.empty_like(p, dtype=torch.bfloat16))
            torch.bmm(ds, kb[:, :e], out=dq[:, r0:r1])
            dk[:, :e] += torch.bmm(ds.mT, qb[:, r0:r1])
        dq = _unheads(dq, b, t, hkv, g, d)
        dk, dv = (_unheads(x, b, s, hkv, 1, d).to(torch.bfloat16) for x in (dk, dv))
        return dq, dk, dv, None, None, None
