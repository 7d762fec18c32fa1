"""TAD: trajectory recording, the near/distant partition, pairs, and CE_near + KL_distant by hand."""

import math

import pytest
import torch

from arbor.dllm.sft import Example
from arbor.train.optim import OptimConfig
from arbor.dllm.tad import (TADConfig, Trajectory, current_block, distill, make_pairs, partition,
                                 record_trajectories, tad_loss)
from tests.test_diffusion_decode import MASK, tiny_model

M = MASK


def test_partition_of_a_hand_made_pair():
    s_k = torch.tensor([5, M, M, M, M, M])
    s_kd = torch.tensor([5, 7, M, 9, M, M])
    region = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)
    near, distant = partition(s_k, s_kd, M, region)
    assert near.tolist() == [False, True, False, True, False, False]
    assert distant.tolist() == [False, False, True, False, False, False]
    near, distant = partition(s_k, s_kd, M)
    assert distant.tolist() == [False, False, True, False, True, True]


def test_current_block_is_the_block_of_the_first_mask():
    # prompt of 3, block 4: response index i sits at position 3 + i; first mask at i = 1 → position 4 → block 1
    state = torch.tensor([7, M, M, M, M, M, M])
    assert current_block(3, state, M, 4).tolist() == [False, True, True, True, True, False, False]
    assert not current_block(3, torch.tensor([7, 8]), M, 4).any()


def test_make_pairs_from_a_recorded_trajectory():
    states = [torch.tensor(s) for s in ([M, M, M, M], [M, 4, M, M], [3, 4, M, M], [3, 4, 2, M], [3, 4, 2, 1])]
    traj = Trajectory(Example([1, 2], [3, 4, 2, 1], [1, 2]), states)
    pairs = make_pairs([traj], delta=2, mask_id=M, block_size=4)   # blocks: positions 0-3 | 4-7
    # k=0: region = response 0,1 (positions 2,3); s_2 reveals both → near {0, 1}
    t, k, region, near, distant, target = pairs[0]
    assert (k, region.tolist(), near.tolist(), distant.tolist()) == (
        0, [True, True, False, False], [True, True, False, False], [False] * 4)
    # k=2: region = response 2,3 (block 1); s_4 reveals both
    k2 = [p for p in pairs if p[1] == 2][0]
    assert k2[3].tolist() == [False, False, True, True] and k2[5].tolist() == [3, 4, 2, 1]
    # k=3 with Δ clipped at K = 4; k=1's region is still block 0, where only response 0 is masked
    k1 = [p for p in pairs if p[1] == 1][0]
    assert k1[3].tolist() == [True, False, False, False] and not k1[4].any()
    assert [p[1] for p in pairs] == [0, 1, 2, 3]
    # with completed blocks: + block 0 at k=2 (s_2 fills its last mask), block 1 at k=4, targets s_k
    extra = make_pairs([traj], delta=2, mask_id=M, block_size=4, completed_blocks=True)[len(pairs):]
    assert [(p[1], p[2].tolist(), p[5].tolist()) for p in extra] == [
        (2, [True, True, False, False], [3, 4, M, M]), (4, [False, False, True, True], [3, 4, 2, 1])]
    assert not any(p[3].any() or p[4].any() for p in extra)


def test_tad_loss_equals_ce_plus_kl_by_hand():
    s = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 2.0], [0.0, 0.0, 3.0]], dtype=torch.float64)   # float64, like
    t = torch.tensor([[9.0, 9.0, 9.0], [2.0, 0.0, 1.0], [1.0, 1.0, -1.0]], dtype=torch.float64)   # the math below
    targets = torch.tensor([1, 0, 2])
    near = torch.tensor([True, False, False])
    distant = torch.tensor([False, True, True])

    def softmax(row):
        e = [math.exp(x) for x in row]
        return [x / sum(e) for x in e]

    ce = -math.log(softmax([1.0, 2.0, 0.0])[1])
    kls = []
    for sr, tr in (([0.5, -1.0, 2.0], [2.0, 0.0, 1.0]), ([0.0, 0.0, 3.0], [1.0, 1.0, -1.0])):
        ps, pt = softmax(sr), softmax(tr)
        kls.append(sum(a * math.log(a / b) for a, b in zip(pt, ps)))
    out = tad_loss(s, t, targets, near, distant)
    assert float(out["ce_near"]) == pytest.approx(ce, rel=1e-12)             # float64 both: measured ≤ 2.7e-16
    assert float(out["kl_distant"]) == pytest.approx(sum(kls) / 2, rel=1e-12)
    assert float(out["loss"]) == pytest.approx(ce + sum(kls) / 2, rel=1e-12)
    empty = torch.zeros(3, dtype=torch.bool)
    assert float(tad_loss(s, t, targets, empty, empty)["loss"]) == 0.0
    # the optional visible term: + w · mean CE of the visible rows against their own tokens
    visible = torch.tensor([False, True, True])
    ce_vis = -(math.log(softmax([0.5, -1.0, 2.0])[0]) + math.log(softmax([0.0, 0.0, 3.0])[2])) / 2
    out = tad_loss(s, t, targets, near, distant, visible, visible_weight=0.5)
    assert float(out["ce_visible"]) == pytest.approx(ce_vis, rel=1e-12)      # float64 both
    assert float(out["loss"]) == pytest.approx(ce + sum(kls) / 2 + 0.5 * ce_vis, rel=1e-12)
    assert "ce_visible" not in tad_loss(s, t, targets, near, distant, visible, visible_weight=0.0)


def test_recorded_trajectories_reveal_one_token_per_step_and_are_filtered():
    teacher = tiny_model(block_size=4, seed=11)
    examples = [Example([5, 6, 7], [0] * 6, [5, 6, 7]), Example([8, 9], [0] * 6, [8, 9])]
    trajs = record_trajectories(teacher, examples, lambda i, toks: True, gen_length=6)
    assert len(trajs) == 2
    for tr in trajs:
        assert bool((tr.states[0] == M).all())
        revealed = [int((s != M).sum()) for s in tr.states]
        assert revealed == list(range(len(revealed)))
        assert all(torch.equal(a[a != M], b[a != M]) for a, b in zip(tr.states, tr.states[1:]))
    assert len(record_trajectories(teacher, examples, lambda i, toks: i == 1, gen_length=6)) == 1


def test_distill_lowers_the_tad_loss_on_its_pairs():
    teacher = tiny_model(block_size=4, seed=12, scale=0.3)
    examples = [Example([5 + i, 6, 7], [0] * 6, [9, 9, 9, 9, 5 + i, 6, 7]) for i in range(6)]   # whole-block ref
    trajs = record_trajectories(teacher, examples, lambda i, toks: True, gen_length=6)
    student = tiny_model(block_size=4, seed=13, scale=0.3)
    log = distill(student, trajs, TADConfig(delta=3, steps=40, batch_size=32, log_every=39,
                                                   optim=OptimConfig(lr=3e-3, warmup_steps=5)), teacher=teacher)
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]
    assert all(not p.requires_grad for p in teacher.parameters())
