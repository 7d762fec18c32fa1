"""Batched sampling with per-request knobs and seeds; the log-prob the trainer compares against.

Log-prob definition (the ``logp_infer`` of IcePop): for a sampled token y,
``logprob = log_softmax(logits.float())[y]`` — the model's distribution at temperature 1 with
no top-k/top-p/min-p filtering, whatever knobs chose y. Top-k log-probs use the same values.

Sampling: z = logits / T; keep the top-k of z; keep the smallest prefix of sorted tokens whose
probability mass reaches top_p (always ≥ 1 token); drop tokens with p < min_p · p_max; then
y = argmax(p / e) with e ~ Exp(1) i.i.d. (the exponential race, exactly a draw from p). A
request with a seed draws its e from its own ``torch.Generator`` — one draw of V values per
token — so its tokens do not depend on the rest of the batch. Greedy rows take argmax(logits).
"""

from __future__ import annotations

import torch

from arbor.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]):
        """logits [B, V] → (tokens [B] list, logprobs [B] list, top-k list of dict or None per row)."""
        logits = logits.float()
        logp = torch.log_softmax(logits, -1)
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            tokens = logits.argmax(-1)
        else:
            tokens = self._sample(logits, seqs)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        tops = [None] * len(seqs)
        k = max(p.logprobs for p in params)
        if k:
            vals, ids = logp.topk(min(k, logp.shape[1]), -1)
            vals, ids = vals.tolist(), ids.tolist()
            tops = [dict(zip(ids[i][:p.logprobs], vals[i][:p.logprobs])) if p.logprobs else None
                    for i, p in enumerate(params)]
        return tokens.tolist(), chosen.tolist(), tops

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        B, V = logits.shape
        dev = logits.device
        params = [s.params for s in seqs]
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
        z = logits / temp[:, None]
        top_k = [p.top_k if p.top_k > 0 else V for p in params]
        if min(top_k) < V or any(p.top_p < 1 for p in params):
            z = self._filter_sorted(z, torch.tensor(top_k, device=dev),
                                    torch.tensor([p.top_p for p in params], device=dev))
        probs = torch.softmax(z, -1)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
        noise = torch.empty(B, V)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), V).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i] = torch.empty(V).exponential_(generator=s.generator)
        tokens = (probs / noise.to(dev)).argmax(-1)
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        return torch.where(greedy, logits.argmax(-1), tokens)

    @staticmethod
    def _filter_sorted(z, top_k, top_p):
        """Mask (−inf) tokens outside each row's top-k and top-p nucleus."""
        sorted_z, order = z.sort(-1, descending=True)
        rank = torch.arange(z.shape[1], device=z.device)
        sorted_z = sorted_z.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(sorted_z, -1)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        return torch.empty_like(z).scatter_(1, order, sorted_z)
