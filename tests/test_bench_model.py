"""``arbor bench model``'s work count: the FLOPs one forward + backward step is credited with."""

import pytest

from arbor.bench.model import SHAPES, step_flops

TINY = dict(hidden_size=4, head_dim=2, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
            vocab_size=10, intermediate_size=3)


def test_step_flops_by_hand():
    # per token: q,k,v,o 2·4·(2·4 + 2·2) = 96; causal attention 4·4·(3 + 1)/2 = 32; SwiGLU 6·4·3 = 72; head 80
    assert step_flops(TINY, seq_len=3, seqs=1) == 3 * (96 + 32 + 72 + 80) * 3
    moe = {k: v for k, v in TINY.items() if k != "intermediate_size"} | dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3)
    # the MLP becomes router 2·4·4 = 32 plus two experts 2·6·4·3 = 144
    assert step_flops(moe, seq_len=3, seqs=2) == 3 * (96 + 32 + 176 + 80) * 6


def test_equal_active_parameters_cost_the_same_work():
    """moe32 (32 experts top-4 of 512) and moe64 (64 top-8 of 256) route the same expert work per token;
    they differ only by the router's 2·D·E."""
    a, b = step_flops(SHAPES["moe32"], 512, 4), step_flops(SHAPES["moe64"], 512, 4)
    router = 3 * SHAPES["moe32"]["num_hidden_layers"] * 2 * 1024 * 32 * 512 * 4
    assert b - a == pytest.approx(router, rel=1e-12)
