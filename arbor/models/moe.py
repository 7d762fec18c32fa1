"""Mixture-of-Experts MLP: softmax top-k router, grouped expert compute, optional shared expert.

Router (Qwen3-MoE / Qwen3-Next): ``p = softmax(x Wᵣᵀ)`` in float32, ``ids = topk(p, k)``,
``w = p[ids]``, renormalised to sum 1 when ``norm_topk_prob``. No token is dropped.
Output: ``y = Σ_j w_j · E_{ids_j}(x)`` (+ ``sigmoid(x w_sᵀ) · S(x)`` with a shared expert S).

Routing replay: given ``ids`` the router still computes ``p`` (so gradients reach it) but uses
those ids, so the same ids and inputs give bit-identical outputs.

Experts are stored fused, ``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``; the
checkpoint layer maps them to HF's per-expert tensors. ``dispatch_experts`` is the one place
that moves tokens to experts; expert-parallel execution replaces it.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from arbor.kernels import fp32_gemm, train_ops
from arbor.models.layers import MLP, Linear
from arbor.models.rows import take_rows


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        if self.gate_up_proj.device.type != "meta":     # (initialising meta tensors costs seconds)
            nn.init.normal_(self.gate_up_proj, std=0.02)
            nn.init.normal_(self.down_proj, std=0.02)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e alone on rows x (reference path; ``grouped`` serves the layers)."""
        return self.grouped([x if i == e else x[:0] for i in range(self.num_experts)])

    def grouped(self, xs: list[torch.Tensor]) -> torch.Tensor | None:
        """xs[e]: the rows for local expert e (possibly none) → the outputs of every non-empty group,
        concatenated in expert order; None when all are empty (``RoutedRows`` on their concatenation)."""
        counts = [x.shape[0] for x in xs]
        if not any(counts):
            return None
        x, gate_up, down = autocast_inputs(torch.cat(xs), self.gate_up_proj, self.down_proj)
        return RoutedRows.apply(x, None, gate_up, down, counts)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype where autocast is on for their device (as autocast casts a linear's
    input and weight; ``RoutedRows`` is beyond autocast's reach), else as they are."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    low = torch.get_autocast_dtype(device)
    return tuple(t.to(low) for t in tensors)


class RoutedRows(torch.autograd.Function):
    """Grouped SwiGLU experts on rows sorted by expert, forward and backward on the routed rows only.

    x [R, D] holds ``counts[e]`` rows for expert e, in expert order; w [R] (or None: 1) weights them:
    ``h = x G_eᵀ`` ([g | u], 2I wide), ``a = silu(g) · u``, ``y = (w · a) D_eᵀ`` (the weight taken on the
    I-wide rows, not the D-wide outputs). Backward, per expert that has rows, with ``t = dy D_e``:
    ``dD_e = dyᵀ (w · a)``, ``dw = Σ_I t · a``, ``da = w · t``, ``du = da · silu(g)``,
    ``dg = da · u · silu'(g)``, ``dG_e = [dg | du]ᵀ x``, ``dx = [dg | du] G_e``.
    Each product is one GEMM per expert (``fp32_gemm.mm_into``) written into one buffer (no per-expert
    zero gradient of the whole [E, …] tensor, no concatenation); experts without rows get a zero weight
    gradient. Saved: x, w and h; a is recomputed from h."""

    @staticmethod
    def forward(ctx, x, w, gate_up, down, counts):
        spans = [(e, a, a + n) for e, (a, n) in enumerate(zip(accumulate(counts, initial=0), counts)) if n]
        inter = down.shape[2]
        h = x.new_empty(x.shape[0], 2 * inter)
        y = x.new_empty(x.shape[0], down.shape[1])
        for e, a, b in spans:
            fp32_gemm.mm_into(h[a:b], x[a:b], gate_up[e].t())
        act = _swiglu(h, w)
        for e, a, b in spans:
            fp32_gemm.mm_into(y[a:b], act[a:b], down[e].t())
        ctx.spans = spans
        ctx.save_for_backward(x, w, gate_up, down, h)
        return y

    @staticmethod
    def backward(ctx, dout):
        x, w, gate_up, down, h = ctx.saved_tensors
        need_x, need_w, need_gu, need_down, _ = ctx.needs_input_grad
        inter, spans = down.shape[2], ctx.spans
        dout = dout.contiguous()
        d_down = _empty_grad(down, spans) if need_down else None
        da = dout.new_empty(dout.shape[0], inter)
        for e, a, b in spans:
            fp32_gemm.mm_into(da[a:b], dout[a:b], down[e])
        if train_ops.available(h, w):
            dh, dw, weighted = train_ops.swiglu_backward(h, w, da, need_w, need_output=need_down)
            dw = None if dw is None else dw.to(w.dtype)
        else:
            weighted = _swiglu(h, w) if need_down else None   # recomputed: cheaper than keeping [R, I]
            g, u = h[:, :inter], h[:, inter:]
            silu_g = F.silu(g)
            dw = (da * (silu_g * u)).sum(-1) if need_w else None
            if w is not None:
                da.mul_(w[:, None])
            dh = torch.empty_like(h)
            torch.ops.aten.silu_backward.grad_input(da * u, g, grad_input=dh[:, :inter])
            torch.mul(da, silu_g, out=dh[:, inter:])
        if need_down:
            for e, a, b in spans:
                fp32_gemm.mm_into(d_down[e], dout[a:b].t(), weighted[a:b])
        dx = torch.empty_like(x) if need_x else None
        d_gate_up = _empty_grad(gate_up, spans) if need_gu else None
        for e, a, b in spans:
            if need_x:
                fp32_gemm.mm_into(dx[a:b], dh[a:b], gate_up[e])
            if need_gu:
                fp32_gemm.mm_into(d_gate_up[e], dh[a:b].t(), x[a:b])
        return dx, dw, d_gate_up, d_down, None


def _swiglu(h: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """h [R, 2I] = [g | u] → ``silu(g) · u`` [R, I], times w [R] when given (``train_ops`` on CPU in bf16 and
    float32)."""
    if train_ops.available(h, w):
        return train_ops.swiglu(h, w)
    inter = h.shape[1] // 2
    act = F.silu(h[:, :inter]).mul_(h[:, inter:])
    return act if w is None else act.mul_(w[:, None])


def _empty_grad(weight: torch.Tensor, spans) -> torch.Tensor:
    """An uninitialised gradient of ``weight`` [E, …] with the experts that have no rows zeroed."""
    grad = torch.empty_like(weight)
    used = {e for e, _, _ in spans}
    for e in range(weight.shape[0]):
        if e not in used:
            grad[e].zero_()
    return grad


def dispatch_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
                     pad: int | None = None) -> torch.Tensor:
    """x [T, D], ids/weights [T, k] → Σ_j weights[:, j] · expert_{ids[:, j]}(x), [T, D].

    Token copies are sorted by expert (one stable argsort) and gathered once; ``RoutedRows`` runs each
    expert that received tokens on its contiguous slice, weighted, and one ``index_add_`` sums the
    copies back per token (bf16 and float32 on CPU: ``train_ops.sum_rows`` gathers each token's k copies and
    sums them in float32, forward and for the gather's backward); the loop is over experts, never over tokens.
    In bfloat16 / float16 on CPU (and float32 where its GEMMs go to oneDNN, ``fp32_gemm``) every expert's
    slice is padded to a multiple of ``pad`` rows (default ``PAD_ROWS``; 1 elsewhere) (copies of token 0
    with weight 0, which add exactly 0 to every output and gradient): oneDNN builds a kernel per GEMM shape, so
    rows counts that change every step would pay that build on every GEMM. An expert module with a
    ``serve`` method (the engine's packed CPU copy) may serve the call itself (when it returns a
    tensor); one that overrides ``grouped`` is called through it outside autograd."""
    serve = getattr(experts, "serve", None)
    if serve is not None and (y := serve(x, ids, weights)) is not None:
        return y
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts)
    if type(experts).grouped is not Experts.grouped and not torch.is_grad_enabled():
        token = order // k
        rows = experts.grouped(list(take_rows(x, token).split(counts.tolist())))
        if rows is None:
            return torch.zeros_like(x)
        return torch.zeros_like(x).index_add_(0, token, rows * weights.reshape(-1)[order, None].to(x.dtype))
    x, weights, gate_up, down = autocast_inputs(x, weights, experts.gate_up_proj, experts.down_proj)
    if pad is None:
        onednn = x.dtype in (torch.bfloat16, torch.float16) or fp32_gemm.active(x)
        pad = PAD_ROWS if x.device.type == "cpu" and onednn else 1
    if pad > 1:
        order, counts = padded_order(order, counts, pad)
    copy_weights = torch.cat([weights.reshape(-1).to(x.dtype), weights.new_zeros(1, dtype=x.dtype)])
    token = torch.where(order < flat.shape[0], order // k, 0)
    if train_ops.available(x):         # CPU: each token's copies summed in float32, gathered, not scattered
        real = order < flat.shape[0]
        pos = torch.empty_like(flat)
        pos[order[real]] = torch.arange(order.shape[0], device=order.device)[real]
        pos = pos.view(-1, k)
        rows = RoutedRows.apply(_TakeRows.apply(x, token, pos), take_rows(copy_weights, order), gate_up, down,
                                counts.tolist())
        return _SumCopies.apply(rows, token, pos)
    rows = RoutedRows.apply(take_rows(x, token), take_rows(copy_weights, order), gate_up, down, counts.tolist())
    return torch.zeros_like(x).index_add_(0, token, rows)


class _TakeRows(torch.autograd.Function):
    """x [T, D] → x[token] [R, D]; backward ∂x[t] = Σ_j ∂rows[pos[t, j]] over token t's k copies (``pos``: where
    each copy sits; padded copies of token 0 carry weight 0, so their gradient is 0 and is left out)."""

    @staticmethod
    def forward(ctx, x, token, pos):
        ctx.save_for_backward(pos)
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        pos, = ctx.saved_tensors
        return train_ops.sum_rows(grad.contiguous(), pos), None, None


class _SumCopies(torch.autograd.Function):
    """rows [R, D] (token copies in expert order) → y [T, D], y[t] = Σ_j rows[pos[t, j]] in float32; backward
    ∂rows = ∂y[token] (a padded copy gets ∂y[0], which its weight 0 turns into 0)."""

    @staticmethod
    def forward(ctx, rows, token, pos):
        ctx.save_for_backward(token)
        return train_ops.sum_rows(rows, pos)

    @staticmethod
    def backward(ctx, grad):
        token, = ctx.saved_tensors
        return grad.index_select(0, token), None, None


PAD_ROWS = 32


def padded_order(order: torch.Tensor, counts: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [R], counts [E]) of copies sorted by expert → (order with each expert's run padded to a
    multiple of ``pad`` by the index R (no copy), padded counts)."""
    padded = (counts + pad - 1) // pad * pad
    start = torch.cumsum(padded, 0) - padded
    rank = torch.arange(order.shape[0], device=order.device) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    out = order.new_full((int(padded.sum()),), order.shape[0])
    out[start.repeat_interleave(counts) + rank] = order
    return out, padded


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.dispatch = dispatch_experts

    def route(self, x: torch.Tensor, ids: torch.Tensor | None = None):
        """→ (ids [T, k] int64, weights [T, k] in x's dtype, router probabilities [T, E] float32).
        Replayed ``ids`` force the experts; a row holding −1 (a token the engine never routed)
        takes its own top-k."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))
        if ids is None:
            weights, ids = probs.topk(self.top_k, dim=-1)
        else:
            if ids.shape != (x.shape[0], self.top_k):
                raise ValueError(f"replayed expert ids have shape {tuple(ids.shape)}, "
                                 f"expected {(x.shape[0], self.top_k)}")
            free = (ids < 0).any(-1, keepdim=True)
            if free.any():
                ids = torch.where(free, probs.topk(self.top_k, dim=-1).indices, ids)
            weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype), probs

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None):
        """x [T, D] → (y [T, D], routed ids [T, k], router probabilities [T, E] float32). An expert
        module with a ``route_and_serve`` method (the engine's packed CPU copy) may run the router
        after its GEMM and the experts itself, when no ids are replayed and the experts are all here
        (``dispatch_experts``, not expert-parallel exchanges)."""
        fused = getattr(self.experts, "route_and_serve", None) if self.dispatch is dispatch_experts else None
        if fused is not None and ids is None and (out := fused(x, self.gate, self.top_k, self.norm_topk_prob)):
            y, ids, probs = out
        else:
            ids, weights, probs = self.route(x, ids)
            y = self.dispatch(x, ids, weights, self.experts)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y, ids, probs


def expert_counts(ids: torch.Tensor, num_experts: int, multiplicity: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert. ids [..., T, k]; multiplicity [T] weights each token (a
    shared tree prefix counts once per trajectory through it). → [..., E]."""
    one_hot = F.one_hot(ids, num_experts).sum(-2).to(torch.float64 if multiplicity is not None else torch.int64)
    if multiplicity is not None:
        one_hot = one_hot * multiplicity.to(torch.float64)[:, None]
    return one_hot.sum(-2)
