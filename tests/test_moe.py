"""Routing replay, expert counts and the grouped dispatch."""

import torch

from arbor.models import CausalLM, ModelConfig, VarlenAttention, expert_counts
from arbor.models.moe import Experts, dispatch_experts
from tests.test_model_attention import HYBRID, MOE


def test_replay_reproduces_logits_exactly():
    for cfg in (MOE, HYBRID):
        torch.manual_seed(0)
        model = CausalLM(ModelConfig(**cfg)).eval()
        ids = torch.randint(0, 64, (30,))
        attn = VarlenAttention.from_lengths([10, 20])
        with torch.no_grad():
            out = model(ids, attn, return_routing=True)
            assert out.routed_experts.shape == (len(model.config.moe_layers), 30, 2)
            replay = model(ids, attn, routed_experts=out.routed_experts)
            assert torch.equal(model.logits(out.hidden), model.logits(replay.hidden))
            # different forced ids change the result: the replay is really used
            other = model(ids, attn, routed_experts=(out.routed_experts + 1) % 4)
            assert not torch.equal(out.hidden, other.hidden)


def test_replay_rows_of_minus_one_route_themselves():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**MOE)).eval()
    ids, attn = torch.randint(0, 64, (12,)), VarlenAttention.from_lengths([12])
    with torch.no_grad():
        own = model(ids, attn, return_routing=True).routed_experts
        forced = (own + 1) % 4
        partial = forced.clone()
        partial[:, :5] = -1                               # the engine routed only tokens 5..11
        got = model(ids, attn, routed_experts=partial, return_routing=True)
        ref = model(ids, attn, routed_experts=torch.cat([own[:, :5], forced[:, 5:]], 1))
        assert torch.equal(got.routed_experts, torch.cat([own[:, :5], forced[:, 5:]], 1))
        assert torch.equal(got.hidden, ref.hidden)


def test_counts_match_ids():
    ids = torch.tensor([[[0, 1], [1, 3], [1, 2]]])
    assert expert_counts(ids, 4).tolist() == [[1, 3, 1, 1]]
    mult = torch.tensor([2.0, 1.0, 1.0])
    assert expert_counts(ids, 4, mult).tolist() == [[2.0, 4.0, 1.0, 1.0]]


def test_dispatch_equals_dense_reference():
    torch.manual_seed(0)
    experts = Experts(5, 16, 8).double()                 # float64: only the order of sums differs
    x = torch.randn(11, 16, dtype=torch.float64)
    ids = torch.randint(0, 5, (11, 3))
    w = torch.rand(11, 3, dtype=torch.float64)
    ref = torch.zeros_like(x)
    for t in range(11):
        for j in range(3):
            ref[t] += w[t, j] * experts.expert_forward(int(ids[t, j]), x[t:t + 1])[0]
    assert torch.allclose(dispatch_experts(x, ids, w, experts), ref, rtol=0, atol=1e-15)   # float64, y ≲ 8e-4: measured 2e-19
