"""Policy-gradient objectives for RL on LLM rollouts, in one function with options.

Per response token t of sample i (three log-probs of the sampled token):

- ``logp``        trainer, current θ, with gradient
- ``logp_old``    trainer's recompute at θ_old (no gradient)
- ``logp_infer``  the engine's log-prob when it sampled the token (θ_old, engine numerics)

    r = exp(logp − logp_old)                     policy ratio (trainer vs trainer)
    k = exp(logp_old − logp_infer)               engine mismatch, no gradient
    ppo = min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)  PPO-clip surrogate
    dual clip (A < 0, c = dual_clip > 1): ppo = max(ppo, c·A)   (Ye et al. 2020; verl's clip_ratio_c)
    correction:
      "none"    w = 1
      "tis"     w = min(k, C)                    truncated importance sampling
      "icepop"  w = k if α ≤ k ≤ β else 0         IcePop (Ring-1T, α=0.5, β=5)
    agg "token":     loss = −1/Σ_i|y_i| · Σ_i Σ_t (w·ppo − γ·kl_t)    (every trained token weighs alike)
    agg "sequence":  loss = −mean_i [ 1/|y_i| Σ_t (w·ppo − γ·kl_t) ]  (every sample weighs alike)

|y_i| counts sample i's trained tokens (loss mask 1: model-written; a tool episode's environment
tokens are not), the sums run over the mini-batch's samples of all ranks. "token" is the DAPO /
Dr. GRPO aggregation (TRL's ``dapo`` and verl's ``token-mean``): under "sequence" a token of a long
sample weighs 1/|y_i| of a short one's, so a long wrong answer (a rambling turn, a tool episode of
many turns) is pushed down less per token than a short one (Liu et al. 2025, "Understanding R1-Zero-
Like Training"). Masked tokens still count in |y_i| (IcePop does not renormalise). With k ≡ 1 (engine and
trainer agree) IcePop and TIS both equal plain PPO-clip exactly. The KL penalty to a frozen
reference, per token with d = logp_ref − logp (Schulman's "Approximating KL divergence"):
  "k1"  −d            "k2"  d² / 2            "k3"  exp(d) − d − 1   (verl's low_var_kl)
Reported per step: masked fraction, |logp_old − logp_infer|, max k, the fractions of tokens where
the low / high clip and the dual clip bind, approx-KL(π_old ‖ π_θ) = mean (r − 1) − log r, and
with a reference the mean penalty estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arbor.configs import check
from arbor.models import expert_counts


KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token", "sequence")


@dataclass
class LossConfig:
    correction: str = "icepop"   # none | tis | icepop
    clip_low: float = 0.2        # ε_low
    clip_high: float = 0.28      # ε_high
    dual_clip: float = 3.0       # c > 1 bounds the loss of a negative-advantage token at c·A (0: off)
    icepop_alpha: float = 0.5
    icepop_beta: float = 5.0
    tis_cap: float = 2.0
    kl_coef: float = 0.0         # γ: > 0 keeps a frozen reference (the starting weights) and adds the penalty
    kl_estimator: str = "k3"     # k1 | k2 | k3
    agg: str = "token"           # token: mean over the step's trained tokens (DAPO) | sequence: per sample, then over samples

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        check(self, (self.correction in ("none", "tis", "icepop"), "correction", "must be none, tis or icepop"),
              (self.kl_estimator in KL_ESTIMATORS, "kl_estimator", "must be k1, k2 or k3"),
              (self.agg in AGGREGATIONS, "agg", "must be token or sequence"),
              (0 <= self.clip_low < 1, "clip_low", "must be in [0, 1)"), (self.clip_high >= 0, "clip_high", "must be ≥ 0"),
              (self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", "must be 0 (off) or > 1"),
              (0 <= self.icepop_alpha <= 1, "icepop_alpha", "must be in [0, 1]"),
              (self.icepop_beta >= 1, "icepop_beta", "must be ≥ 1"),
              (self.tis_cap > 0, "tis_cap", "must be > 0"), (self.kl_coef >= 0, "kl_coef", "must be ≥ 0"))


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π (see module docstring)."""
    d = logp_ref.detach() - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got '{estimator}'")


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
                cfg: LossConfig, logp_ref=None, num_tokens: float | None = None):
    """All token tensors are flat [N] over the response tokens of a micro-batch.

    advantages [N] (the sample's advantage on each of its tokens), mask [N] (1 = trained token),
    seq_index [N] (which sample a token belongs to, in [0, num_seqs)). Returns (loss, stats):
    the negated objective aggregated as ``cfg.agg`` says (module docstring) — over the ``num_seqs``
    samples ("sequence") or the ``num_tokens`` trained tokens ("token"; default: this call's
    ``mask.sum()``). Pass the mini-batch's global counts so that micro-batches add up to its loss."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp_old.detach())
    surr = torch.minimum(ratio * advantages,
                         ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages)
    dual = torch.zeros_like(surr, dtype=torch.bool)
    if cfg.dual_clip:
        dual = (advantages < 0) & (surr < cfg.dual_clip * advantages)
        surr = torch.where(dual, cfg.dual_clip * advantages, surr)
    w, k = mismatch_weights(logp_old, logp_infer, cfg)
    per_token = w * surr
    kl = None
    if cfg.kl_coef and logp_ref is not None:
        kl = kl_penalty(logp, logp_ref, cfg.kl_estimator)
        per_token = per_token - cfg.kl_coef * kl
    if cfg.agg == "token":
        total = float(mask.sum()) if num_tokens is None else num_tokens
        loss = -(per_token * mask).sum() / max(total, 1.0)
    else:
        lengths = torch.zeros(num_seqs, dtype=logp.dtype, device=logp.device).index_add_(0, seq_index, mask)
        per_seq = torch.zeros_like(lengths).index_add_(0, seq_index, per_token * mask)
        loss = -(per_seq / lengths.clamp(min=1)).sum() / num_seqs
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        mean = lambda x: float((x.to(mask.dtype) * mask).sum() / n)
        in_band = (k >= cfg.icepop_alpha) & (k <= cfg.icepop_beta)
        r = ratio.detach()
        stats = {
            "masked_frac": mean(~in_band),
            "mismatch_abs": mean((logp_old - logp_infer).abs()),
            "max_k": float((k * mask).max()) if mask.any() else 1.0,
            "clip_low": mean((r < 1 - cfg.clip_low) & (advantages < 0)),      # where the clip binds
            "clip_high": mean((r > 1 + cfg.clip_high) & (advantages > 0)),
            "dual_clip_frac": mean(dual),
            "approx_kl": mean(r - 1 - torch.log(r)),
            "tokens": float(mask.sum()),
        }
        if kl is not None:
            stats["kl_ref"] = mean(kl.detach())
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
