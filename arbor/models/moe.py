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

import torch
import torch.nn.functional as F
from torch import nn

from arbor.models.layers import MLP
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
        concatenated in expert order; None when all are empty. The weights are split with one
        ``unbind`` per call: indexing ``gate_up_proj[e]`` per expert would make backward build and add
        a zero gradient of the whole [E, …] tensor for every expert."""
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        out = []
        for e, x in enumerate(xs):
            if x.shape[0]:
                gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
                out.append(F.linear(F.silu(gate) * up, down[e]))
        return torch.cat(out) if out else None


def dispatch_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
    """x [T, D], ids/weights [T, k] → Σ_j weights[:, j] · expert_{ids[:, j]}(x), [T, D].

    Token copies are sorted by expert so each expert runs one matmul on a contiguous slice;
    the loop is over experts, never over tokens. An expert module with a ``serve`` method (the
    engine's packed CPU copy) may serve the call itself (when it returns a tensor)."""
    serve = getattr(experts, "serve", None)
    if serve is not None and (y := serve(x, ids, weights)) is not None:
        return y
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    rows = experts.grouped(list(take_rows(x, token).split(counts)))
    if rows is None:
        return torch.zeros_like(x)
    y = rows * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
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
