"""Known-value tests of the policy losses and advantages."""

import math

import pytest
import torch

from arbor.train.advantages import group_advantages
from arbor.train.losses import LossConfig, mismatch_weights, policy_loss


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
