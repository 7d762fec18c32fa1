"""Policy-gradient objectives for RL on LLM rollouts, in one function with options.

Per response token t of sample i (three log-probs of the sampled token):

- ``logp``        trainer, current θ, with gradient
- ``logp_old``    trainer's recompute at θ_old (no gradient)
- ``logp_infer``  the engine's log-prob when it sampled the token (θ_old, engine numerics)

    r = exp(logp − logp_old)                     policy ratio (trainer vs trainer)
    k = exp(logp_old − logp_infer)               engine mismatch, no gradient
    ppo = min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)  PPO-clip surrogate
    correction:
      "none"    w = 1
      "tis"     w = min(k, C)                    truncated importance sampling
      "icepop"  w = k if α ≤ k ≤ β else 0         IcePop (Ring-1T, α=0.5, β=5)
    loss = −mean_i [ 1/|y_i| Σ_t w·ppo ] + γ·KL(π‖π_ref)

Masked tokens still count in |y_i| (IcePop does not renormalise). With k ≡ 1 (engine and
trainer agree) IcePop and TIS both equal plain PPO-clip exactly. The KL term uses the
"k3" estimator  exp(ref − logp) − (ref − logp) − 1  per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arbor.models import expert_counts


@dataclass
class LossConfig:
    correction: str = "icepop"   # none | tis | icepop
    clip_low: float = 0.2
    clip_high: float = 0.28
    icepop_alpha: float = 0.5
    icepop_beta: float = 5.0
    tis_cap: float = 2.0
    kl_coef: float = 0.0

    def __post_init__(self):
        if self.correction not in ("none", "tis", "icepop"):
            raise ValueError(f"loss.correction must be none, tis or icepop, got '{self.correction}'")


def mismatch_weights(logp_old: torch.Tensor, logp_infer: torch.Tensor, cfg: LossConfig):
    """→ (w, k): the per-token correction weight and the mismatch ratio k (no gradient)."""
    k = torch.exp(logp_old.detach() - logp_infer.detach())
    if cfg.correction == "icepop":
        w = torch.where((k >= cfg.icepop_alpha) & (k <= cfg.icepop_beta), k, torch.zeros_like(k))
    elif cfg.correction == "tis":
        w = k.clamp(max=cfg.tis_cap)
    else:
        w = torch.ones_like(k)
    return w, k


def policy_loss(logp, logp_old, logp_infer, advantages, mask, seq_index, num_seqs: int,
                cfg: LossConfig, logp_ref=None):
    """All token tensors are flat [N] over the response tokens of a micro-batch.

    advantages [N] (the sample's advantage on each of its tokens), mask [N] (1 = trained token),
    seq_index [N] (which sample a token belongs to, in [0, num_seqs)). Returns (loss, stats):
    the loss is the negated objective averaged over the ``num_seqs`` samples (pass the global
    number of samples of the step so micro-batches add up to the step's mean)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp_old.detach())
    surr = torch.minimum(ratio * advantages,
                         ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages)
    w, k = mismatch_weights(logp_old, logp_infer, cfg)
    per_token = w * surr
    if cfg.kl_coef and logp_ref is not None:
        d = logp_ref.detach() - logp
        per_token = per_token - cfg.kl_coef * (torch.exp(d) - d - 1)
    lengths = torch.zeros(num_seqs, dtype=logp.dtype, device=logp.device).index_add_(0, seq_index, mask)
    per_seq = torch.zeros_like(lengths).index_add_(0, seq_index, per_token * mask)
    loss = -(per_seq / lengths.clamp(min=1)).sum() / num_seqs
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        in_band = (k >= cfg.icepop_alpha) & (k <= cfg.icepop_beta)
        stats = {
            "masked_frac": float(((~in_band).to(mask.dtype) * mask).sum() / n),
            "mismatch_abs": float(((logp_old - logp_infer).abs() * mask).sum() / n),
            "max_k": float((k * mask).max()) if mask.any() else 1.0,
            "clip_frac": float((((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)).to(mask.dtype) * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
    return loss, stats


def moe_aux_loss(probs: torch.Tensor, ids: torch.Tensor, multiplicity: torch.Tensor) -> torch.Tensor:
    """Switch-style load-balancing loss with semantic multiplicities, for router probabilities
    probs [T, E] (float) and routed ids [T, k] of one MoE layer on compact tokens:

        f_e = Σ_i m_i · #{j: ids_ij = e} / (k · Σ_i m_i),   P_e = Σ_i m_i · p_ie / Σ_i m_i,
        L = E · Σ_e f_e · P_e

    — the value trajectory-wise training gets over all trajectories' tokens."""
    m = multiplicity.to(probs.dtype)
    E, k = probs.shape[1], ids.shape[1]
    f = expert_counts(ids, E, multiplicity).to(probs.dtype) / (k * m.sum())
    P = (m[:, None] * probs).sum(0) / m.sum()
    return E * (f * P).sum()


def router_aux_loss(router_probs: torch.Tensor | None, routed_experts: torch.Tensor | None,
                    multiplicity: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_aux_loss`` averaged over MoE layers: router_probs [layers, T, E], routed_experts
    [layers, T, k] (what the forward returned), multiplicity [T] (default 1 per token). A dense
    model (no MoE layers) → 0."""
    if router_probs is None:
        return torch.zeros(())
    m = multiplicity if multiplicity is not None else torch.ones(router_probs.shape[1], device=router_probs.device)
    return torch.stack([moe_aux_loss(p, i, m) for p, i in zip(router_probs, routed_experts)]).mean()
