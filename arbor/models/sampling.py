"""The distribution a token is sampled from, as log-probs — shared by the engine's sampler and the
trainer, so ``logp_infer`` and ``logp_old`` / ``logp`` describe the same distribution.

For logits ℓ [N, V] and per-row knobs: z = ℓ / T; keep the top-k of z; keep the smallest prefix of
tokens sorted by z whose probability mass reaches top_p (always ≥ 1 token); drop tokens with
p < min_p · p_max; renormalise:

    log π_T(y) = log softmax(z_kept)[y]   (−inf for a dropped token)

T = 0 (greedy) rows use T = 1 with no truncation (the model's own distribution), as does
``SamplingSpec()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype) and per-row knobs [N] → log-probs [N, V] float32, float64 for
    float64 logits (see module docstring; a temperature ≤ 0 counts as 1 with no truncation, top_k ≤ 0 as off)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(z)
    z = z / t[:, None]
    V = z.shape[1]
    k = torch.where((top_k <= 0) | greedy, torch.full_like(top_k, V), top_k.clamp(max=V))
    p = torch.where(greedy, torch.ones_like(top_p), top_p).to(z)
    if bool((k < V).any()) or bool((p < 1).any()):
        sorted_z, order = z.sort(-1, descending=True)
        rank = torch.arange(V, device=z.device)
        sorted_z = sorted_z.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
        probs = torch.softmax(sorted_z, -1)
        drop = (probs.cumsum(-1) - probs) >= p[:, None]
        drop[:, 0] = False
        z = torch.empty_like(z).scatter_(1, order, sorted_z.masked_fill(drop, float("-inf")))
    m = torch.where(greedy, torch.zeros_like(min_p), min_p).to(z)
    if bool((m > 0).any()):
        probs = torch.softmax(z, -1)
        z = z.masked_fill(probs < m[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return torch.log_softmax(z, -1)


@dataclass(frozen=True)
class SamplingSpec:
    """One set of knobs for every row (the trainer's view of the rollout's sampling)."""
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def is_plain(self) -> bool:
        return self.temperature in (0, 1) and self.top_k <= 0 and self.top_p >= 1 and self.min_p <= 0

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] → log π_T [N, V] float32 (float64 for float64 logits; the knobs are kept in
        float64, and rounded to the logits' dtype where they are used)."""
        if self.is_plain:
            return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        n, dev = logits.shape[0], logits.device
        full = lambda v, dt: torch.full((n,), v, dtype=dt, device=dev)
        return processed_logprobs(logits, full(self.temperature, torch.float64), full(self.top_k, torch.int64),
                                  full(self.top_p, torch.float64), full(self.min_p, torch.float64))
