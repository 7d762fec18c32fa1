"""Batched sampling with per-request knobs and seeds; the log-prob the trainer compares against.

Log-prob definition (the ``logp_infer`` of IcePop): the log-prob of y under the distribution it
was drawn from — ``arbor.models.sampling.processed_logprobs``: logits / T, truncated by top-k,
top-p and min-p, renormalised — which the trainer computes the same way from its own logits.
Greedy rows (T = 0) report the model's own distribution (T = 1, no truncation). Top log-probs
come from the same distribution (dropped tokens are never listed).

Sampling: y = argmax(π_T / e) with e ~ Exp(1) i.i.d. (the exponential race, exactly a draw from
π_T). A request with a seed draws its e from its own ``torch.Generator`` — one draw of V values per
token — so its tokens do not depend on the rest of the batch. Greedy rows take argmax(logits).
"""

from __future__ import annotations

import torch

from arbor.engine.sequence import Sequence
from arbor.models.sampling import processed_logprobs


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]):
        """logits [B, V] → (tokens [B] list, logprobs [B] list, top-k list of dict or None per row)."""
        logits = logits.float()
        params = [s.params for s in seqs]
        if all(p.greedy and not p.logprobs for p in params):
            # the common rollout-eval case, without the knob tensors and truncation checks: a greedy row's
            # distribution is the model's own (T = 1 divides by one, nothing truncated), bit for bit the same
            logp = torch.log_softmax(logits, -1)
            tokens = logits.argmax(-1)
            return tokens.tolist(), logp.gather(1, tokens[:, None])[:, 0].tolist(), [None] * len(seqs)
        dev = logits.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        if all(p.greedy or (p.top_k == -1 and p.top_p == 1 and p.min_p == 0) for p in params):
            # no row truncates: ``processed_logprobs``' own ops without its knob tensors and checks
            logp = torch.log_softmax(logits / torch.where(temperature > 0, temperature, 1.0)[:, None], -1)
        else:
            knob = lambda name, dt: torch.tensor([getattr(p, name) for p in params], dtype=dt, device=dev)
            logp = processed_logprobs(logits, temperature, knob("top_k", torch.int64), knob("top_p", torch.float32),
                                      knob("min_p", torch.float32))
        if not any(p.greedy for p in params):
            tokens = self._race(logp, seqs)
        else:
            tokens = logits.argmax(-1)
            if not all(p.greedy for p in params):
                tokens = torch.where(temperature > 0, self._race(logp, seqs), tokens)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        tops = [None] * len(seqs)
        k = max(p.logprobs for p in params)
        if k:
            vals, ids = logp.topk(min(k, logp.shape[1]), -1)
            vals, ids = vals.tolist(), ids.tolist()
            tops = [{i: v for i, v in zip(ids[r][:p.logprobs], vals[r][:p.logprobs]) if v != float("-inf")}
                    if p.logprobs else None for r, p in enumerate(params)]
        return tokens.tolist(), chosen.tolist(), tops

    def _race(self, logp: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One draw per row from exp(logp) by the exponential race."""
        B, V = logp.shape
        noise = torch.empty(B, V)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), V).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)     # in place: the same V draws
        return (logp.exp() / noise.to(logp.device)).argmax(-1)
