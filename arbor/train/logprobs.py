"""Per-token log-probs of packed sequences under the trainer's model.

For a packed call over sequences s (tokens x_0..x_{L-1} each), the result is flat [T] aligned
with the tokens: entry t holds log π(x_t | x_<t) for t ≥ 1 and 0 at each sequence's first
token (which has no prediction). Log-softmax runs in float32 in row chunks, so the [T, V]
float32 logits never exist whole for a large vocabulary.

``spec`` (``arbor.models.sampling.SamplingSpec``) gives the log-probs of the distribution the
rollout sampled from (logits / T, truncated as the engine truncated); None is the model's own
distribution. ``entropy``: a list that receives the per-token entropy of that distribution (no
gradient, for metrics) — per chunk from ``gather_logprobs``; ``packed_logprobs`` leaves one tensor
in it aligned with its log-probs (the entropy of the distribution each token was drawn from).
"""

from __future__ import annotations

import torch

from arbor.models import VarlenAttention
from arbor.train.losses import router_aux_loss


def gather_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 4096, spec=None,
                    entropy: list | None = None) -> torch.Tensor:
    """log π(targets_i | hidden_i) for every row i, in float32 (π: see module docstring)."""
    out = []
    for s in range(0, hidden.shape[0], chunk):
        logits = model.logits(hidden[s:s + chunk])
        wide = torch.promote_types(logits.dtype, torch.float32)          # float64 for a float64 model
        logp = spec.logprobs(logits) if spec is not None else logits.to(wide).log_softmax(-1)
        out.append(logp.gather(1, targets[s:s + chunk, None])[:, 0])
        if entropy is not None:
            with torch.no_grad():
                p = logp.exp()
                entropy.append(-(p * logp.masked_fill(p == 0, 0.0)).sum(-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def packed_logprobs(model, seqs: list[list[int]], device=None, routed_experts=None, with_aux: bool = False,
                    spec=None, entropy: list | None = None):
    """→ (logp [T] float32, cu_seqlens [N+1]) for the sequences packed in order, and with
    ``with_aux`` the MoE load-balancing loss (``losses.router_aux_loss``) over their tokens."""
    device = device or model.device
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    attn = VarlenAttention.from_lengths([len(s) for s in seqs], device=device)
    out = model(ids, attn, routed_experts=routed_experts, return_router_probs=with_aux)
    hidden = out.hidden
    # predict token t+1 from position t; the first token of each sequence gets 0
    starts = attn.cu_seqlens[:-1]
    nxt = torch.roll(ids, -1)
    logp_next = gather_logprobs(model, hidden, nxt, spec=spec, entropy=entropy)
    logp = torch.roll(logp_next, 1)
    logp[starts] = 0.0
    if entropy is not None:
        ent = torch.roll(torch.cat(entropy), 1)
        ent[starts] = 0.0
        entropy[:] = [ent]
    if with_aux:
        return logp, attn.cu_seqlens, router_aux_loss(out.router_probs, out.routed_experts)
    return logp, attn.cu_seqlens
