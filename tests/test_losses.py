"""Known-value tests of the policy losses and advantages.

Tolerances: a few float32 operations on values ≲ 10 against the same formula in Python floats, so the
default ``pytest.approx`` (rel 1e-6) and ``torch.allclose`` (rtol 1e-5) leave ≥ 16 float32 roundings (2^-24)."""

import math

import pytest
import torch

from arbor.train.advantages import group_advantages
from arbor.train.losses import LossConfig, kl_penalty, mismatch_weights, policy_loss


def batch(seed=0, n=40, seqs=5):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(n, generator=g) * 3
    logp = (logp_old + 0.3 * torch.randn(n, generator=g)).requires_grad_()
    adv = torch.randn(seqs, generator=g)
    seq = torch.arange(n) % seqs
    mask = (torch.rand(n, generator=g) > 0.2).float()
    return logp, logp_old, adv[seq], mask, seq


@pytest.mark.parametrize("correction", ["icepop", "tis"])
def test_equals_ppo_when_engine_agrees(correction):
    logp, logp_old, adv, mask, seq = batch()
    ppo, _ = policy_loss(logp, logp_old, logp_old, adv, mask, seq, 5, LossConfig(correction="none"))
    got, stats = policy_loss(logp, logp_old, logp_old, adv, mask, seq, 5, LossConfig(correction=correction))
    assert torch.equal(ppo, got)
    assert stats["masked_frac"] == 0.0 and stats["max_k"] == 1.0


def test_icepop_mask_and_weights_known_values():
    logp_old = torch.zeros(5)
    logp_infer = -torch.log(torch.tensor([0.4, 0.5, 1.0, 5.0, 6.0]))  # k = 0.4, 0.5, 1, 5, 6
    w, k = mismatch_weights(logp_old, logp_infer, LossConfig(correction="icepop"))
    assert torch.allclose(k, torch.tensor([0.4, 0.5, 1.0, 5.0, 6.0]))
    assert torch.allclose(w, torch.tensor([0.0, 0.5, 1.0, 5.0, 0.0]))
    w, _ = mismatch_weights(logp_old, logp_infer, LossConfig(correction="tis", tis_cap=2.0))
    assert torch.allclose(w, torch.tensor([0.4, 0.5, 1.0, 2.0, 2.0]))


def test_loss_by_hand():
    # one sequence of 3 tokens, ratio = 1 (on-policy), k = (1, 10, 1) → middle token masked by IcePop
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    infer = torch.tensor([-1.0, -2.0 - math.log(10), -0.5])
    adv = torch.full((3,), 2.0)
    loss, stats = policy_loss(logp, logp.detach(), infer, adv, torch.ones(3), torch.zeros(3, dtype=torch.long), 1,
                              LossConfig(correction="icepop"))
    assert loss.item() == pytest.approx(-(2.0 + 0.0 + 2.0) / 3)   # masked token still counts in |y|
    assert stats["masked_frac"] == pytest.approx(1 / 3)
    assert stats["max_k"] == pytest.approx(10.0)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-2 / 3, 0.0, -2 / 3]))


def test_clipping_stops_gradient():
    logp_old = torch.zeros(2)
    logp = torch.log(torch.tensor([1.5, 0.5])).requires_grad_()
    loss, _ = policy_loss(logp, logp_old, logp_old, torch.tensor([1.0, -1.0]), torch.ones(2),
                          torch.zeros(2, dtype=torch.long), 1, LossConfig(correction="none"))
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2))  # both ratios outside the band in the direction of A


def test_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = group_advantages(r, g)
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()
    assert torch.allclose(a[:4], (torch.tensor([1.0, 0.0, 1.0, 0.0]) - 0.5) / (std + 1e-6), atol=1e-5)
    assert torch.equal(a[4:], torch.zeros(2))
    rloo = group_advantages(r, g, method="rloo")
    assert rloo[0].item() == pytest.approx(1.0 - 1 / 3)
    with pytest.raises(ValueError, match="grpo or rloo"):
        group_advantages(r, g, method="ppo")


def test_dual_clip_bounds_a_negative_advantage_loss_at_c_times_a():
    """r = 5, A = −1: PPO-clip gives min(−5, −1.28) = −5; the dual clip (c = 3) lifts it to −3, no gradient."""
    logp_old = torch.zeros(3)
    logp = torch.log(torch.tensor([5.0, 2.0, 5.0])).requires_grad_()
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, stats = policy_loss(logp, logp_old, logp_old, adv, torch.ones(3), torch.arange(3), 3,
                              LossConfig(correction="none", dual_clip=3.0))
    # token 0: max(−5, −3) = −3 (dual clip binds); token 1: min(−2, −1.28) = −2; token 2: min(5, 1.28) = 1.28
    assert loss.item() == pytest.approx(-(-3.0 - 2.0 + 1.28) / 3)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 3) and stats["clip_high"] == pytest.approx(1 / 3)
    loss.backward()
    assert logp.grad[0] == 0 and logp.grad[2] == 0 and logp.grad[1] != 0
    off, _ = policy_loss(logp, logp_old, logp_old, adv, torch.ones(3), torch.arange(3), 3,
                         LossConfig(correction="none", dual_clip=0))
    assert off.item() == pytest.approx(-(-5.0 - 2.0 + 1.28) / 3)


@pytest.mark.parametrize("estimator,by_hand", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (ref - lp) ** 2),
    ("k3", lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1)])
def test_kl_estimators_by_hand(estimator, by_hand):
    lp, ref = [-0.5, -2.0, -1.0], [-1.0, -1.5, -1.0]
    got = kl_penalty(torch.tensor(lp), torch.tensor(ref), estimator)
    assert got.tolist() == pytest.approx([by_hand(a, b) for a, b in zip(lp, ref)])
    logp = torch.tensor(lp, requires_grad=True)
    cfg = LossConfig(correction="none", kl_coef=0.1, kl_estimator=estimator)
    with_kl, stats = policy_loss(logp, logp.detach(), logp.detach(), torch.zeros(3), torch.ones(3),
                                 torch.zeros(3, dtype=torch.long), 1, cfg, logp_ref=torch.tensor(ref))
    assert with_kl.item() == pytest.approx(0.1 * sum(by_hand(a, b) for a, b in zip(lp, ref)) / 3)
    assert stats["kl_ref"] == pytest.approx(sum(by_hand(a, b) for a, b in zip(lp, ref)) / 3)


def test_token_and_sequence_aggregation_by_hand():
    # two on-policy samples (r = 1): 1 token at A = +1, 3 tokens at A = −1 (one of them not trained)
    logp = torch.tensor([-1.0, -0.5, -0.5, -0.5], requires_grad=True)
    adv, mask, seq = torch.tensor([1.0, -1.0, -1.0, -1.0]), torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 1, 1, 1])
    token, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, seq, 2, LossConfig(correction="none", agg="token"))
    assert token.item() == pytest.approx(-(1.0 - 1.0 - 1.0) / 3)          # Σ over trained tokens ÷ their number
    token.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1 / 3, 1 / 3, 1 / 3, 0.0]))   # every trained token weighs alike
    logp.grad = None
    per_seq, _ = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, seq, 2,
                             LossConfig(correction="none", agg="sequence"))
    assert per_seq.item() == pytest.approx(-(1.0 / 1 - 2.0 / 2) / 2)       # mean per sample, then over samples
    per_seq.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1 / 2, 1 / 4, 1 / 4, 0.0]))


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_micro_batches_add_up_to_the_whole(agg):
    """Split over micro-batches with the global counts (samples, trained tokens), the losses sum to the
    loss of the whole batch, as ``PolicyUpdate._train_mini`` relies on."""
    *floats, seq = batch(seed=3)
    logp, logp_old, adv, mask = (t.detach().double() for t in floats)   # float64: any summation order agrees
    cfg = LossConfig(correction="none", agg=agg)
    whole, _ = policy_loss(logp, logp_old, logp_old, adv, mask, seq, 5, cfg)
    parts = [seq < 2, seq >= 2]
    summed = sum(policy_loss(logp[p], logp_old[p], logp_old[p], adv[p], mask[p], seq[p], 5, cfg,
                             num_tokens=float(mask.sum()))[0] for p in parts)
    assert summed.item() == pytest.approx(whole.item(), rel=1e-12)


def test_loss_config_rejects_unknown_names_and_ranges():
    for bad, match in [(dict(correction="icepp"), "correction must be"), (dict(kl_estimator="k4"), "kl_estimator"),
                       (dict(agg="seq"), "agg must be"),
                       (dict(dual_clip=0.5), "dual_clip"), (dict(kl_coef=-1.0), "kl_coef")]:
        with pytest.raises(ValueError, match=match):
            LossConfig(**bad)
