"""Mixed precision (arbor.train.precision): a bf16-autocast SFT run tracks the float32 run, its
parameters and moments stay float32, an RL step's IcePop statistics see the bf16 train / float32
engine mismatch, and bad dtypes are refused naming the key."""

import asyncio
import copy

import pytest
import torch

from arbor.bench.rl_setup import make_trainer
from arbor.configs import load
from arbor.models import CausalLM, ModelConfig
from arbor.train.optim import OptimConfig
from arbor.train.sft import SFTConfig, SFTRunConfig, sft
from arbor.train.tree_batch import TreeConfig
from tests.test_rl_loop import config
from tests.test_sft import SMALL, examples


HYBRID_MOE = dict(architecture="Qwen3NextForCausalLM", layer_types=["linear_attention", "full_attention"],
                  num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)


@pytest.mark.parametrize("kind", ["dense", "hybrid-moe"])
def test_bf16_sft_tracks_the_float32_run(kind, one_thread):
    tok, ex = examples()
    torch.manual_seed(0)
    a = CausalLM(ModelConfig(**(SMALL | (HYBRID_MOE if kind == "hybrid-moe" else {})), eos_token_id=tok.eos_token_id))
    b = copy.deepcopy(a)
    cfg = dict(steps=20, log_every=1, batch_tokens=1500, tree=TreeConfig(token_cap=800),
               optim=OptimConfig(lr=3e-3, warmup_steps=0))
    full = [r["loss"] for r in sft(a, ex, SFTConfig(**cfg))]
    half = [r["loss"] for r in sft(b, ex, SFTConfig(dtype="bfloat16", **cfg))]
    assert all(p.dtype == torch.float32 for p in b.parameters())          # master weights
    # bound: bf16's unit roundoff 2^-9 ≈ 0.2 % on each of ~5 rounded matmul outputs behind a token's log-prob
    # gives ≲ 1 % per token; the loss averages ~1000 tokens, which can only shrink it (measured ≤ 1.1e-4 dense).
    assert full[-1] < 0.75 * full[0]                                       # it trains (4.9 → 2.8)
    for f, h in zip(full, half):
        assert abs(f - h) <= 0.01 * f, (full, half)
    assert full != half                                                    # bf16 did run


def test_bf16_rl_step_shows_the_mismatch_to_a_float32_engine(one_thread):
    from arbor.models.tokenizer import builtin_tokenizer
    from tests.test_rl_loop import SMALL as RL_SMALL
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**RL_SMALL, eos_token_id=tok.eos_token_id)).eval()
    opt = OptimConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0)
    full = asyncio.run(make_trainer(config(optim=opt), copy.deepcopy(model), tok).train_step())
    half = asyncio.run(make_trainer(config(optim=opt, dtype="bfloat16"), copy.deepcopy(model), tok).train_step())
    # a float32 trainer sharing the engine's tensors differs by the order of sums only (measured 7e-8); bf16
    # logits carry a relative error of up to 2^-9 ≈ 2e-3, i.e. ~1e-3 on log-probs of logits ~1 (measured 5.7e-4)
    assert full["mismatch_abs"] < 1e-5 < 1e-4 < half["mismatch_abs"], (full["mismatch_abs"], half["mismatch_abs"])


@pytest.mark.parametrize("override,message", [
    ("train.dtype=bf16", "train.dtype must be one of float32, bfloat16, float16"),
    ("train.dtype=float16", "train.dtype=float16 trains on CUDA only"),
])
def test_bad_dtypes_are_refused_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load(SFTRunConfig, overrides=[override])


def test_rl_dtype_is_checked_at_load():
    from arbor.train.config import RLConfig
    with pytest.raises(ValueError, match="dtype=float16 trains on CUDA only"):
        load(RLConfig, overrides=["dtype=float16"])
    assert load(RLConfig, overrides=["dtype=bfloat16"]).dtype == "bfloat16"
