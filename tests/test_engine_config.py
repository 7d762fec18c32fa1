"""EngineConfig / LLMEngine refuse, at construction and with a ValueError naming the knob, every
setting under which the engine could never run a request (instead of spinning forever)."""

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.engine.policies import POLICIES
from arbor.models import CausalLM, ModelConfig, VarlenAttention


@pytest.mark.parametrize("knob, value", [
    ("max_num_seqs", 0), ("max_num_seqs", -2), ("max_num_batched_tokens", 0), ("num_blocks", 0),
    ("num_blocks", -1), ("block_size", 0), ("block_size", -16), ("max_model_len", 0), ("max_model_len", 1),
    ("kv_cache_bytes", 0), ("kv_memory_fraction", 0.0), ("kv_memory_fraction", 1.5), ("state_snapshots", -1),
    ("max_num_seqs", 2.5), ("block_size", True), ("policy", "fastest"), ("dtype", "int8"),
])
def test_bad_knobs_are_refused_at_construction(knob, value):
    with pytest.raises(ValueError, match=knob if knob != "dtype" else "dtype"):
        EngineConfig(**{knob: value})


def test_the_engine_checks_a_config_changed_after_construction():
    model = CausalLM(ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, head_dim=8,
                                 num_hidden_layers=1)).eval()
    cfg = EngineConfig()
    cfg.max_num_batched_tokens = 0
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(model, cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    model = CausalLM(ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, head_dim=8,
                                 num_hidden_layers=1)).eval()
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="CUDA is not available"):
            LLMEngine(model, EngineConfig(device=device))
    with pytest.raises(ValueError, match="not a device"):
        EngineConfig(device="gpu0").check_device()


def tiny_model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, head_dim=8,
                                num_hidden_layers=1)).eval()


def greedy_reference(model, prompt, new):
    """Greedy tokens from full forwards over the whole sequence (no engine, no KV cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            hidden = model(torch.tensor(ids), VarlenAttention.from_lengths([len(ids)])).hidden
            ids.append(int(model.logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_good_configs_still_build():
    """The smallest engine that can serve a request (2 KV slots, one sequence, one token per step) and one
    with most knobs off their defaults: each engine holds the settings it was given and generates the
    greedy tokens of a plain forward."""
    model = tiny_model()
    small = LLMEngine(model, EngineConfig(num_blocks=2, block_size=1, max_num_seqs=1, max_num_batched_tokens=1,
                                          max_model_len=2, device="cpu"))
    assert (small.max_model_len, len(small.block_manager.blocks), small.block_manager.block_size) == (2, 2, 1)
    assert (small.scheduler.max_num_seqs, small.scheduler.budget) == (1, 1) and small.model.device == torch.device("cpu")
    outs = small.generate([[3], [5]], greedy(1))
    assert [o.token_ids for o in outs] == [greedy_reference(model, [3], 1), greedy_reference(model, [5], 1)]
    assert small.num_steps == 2                     # max_num_seqs=1: one sequence per forward
    with pytest.raises(ValueError, match="context length is 2"):
        small.generate([[3, 4]], greedy(1))
    cfg = EngineConfig(num_blocks=9, block_size=8, max_num_seqs=2, max_num_batched_tokens=9, max_model_len=40,
                       policy="prefill-first", enable_prefix_caching=False)
    engine = LLMEngine(model, cfg)
    assert (engine.max_model_len, len(engine.block_manager.blocks), engine.block_manager.block_size) == (40, 9, 8)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.budget) == (2, 9)
    assert type(engine.scheduler.policy) is POLICIES["prefill-first"] and not engine.block_manager.enable_prefix_caching
    prompts = [list(range(1, 14)), [7, 3, 9, 2, 30, 11]]         # 13 tokens: prefill chunks of 9 and 4
    assert [o.token_ids for o in engine.generate(prompts, greedy(4))] == [greedy_reference(model, p, 4) for p in prompts]
    bf16 = LLMEngine(model, EngineConfig(dtype="bfloat16"))     # its own converted copy
    assert bf16.model is not model and bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert EngineConfig(device="cpu").check_device() == torch.device("cpu")


def test_one_token_prefill_chunks_give_the_greedy_tokens():
    """max_num_batched_tokens=1 (every prefill chunk one token), and a budget of 3 where a new prompt's first
    chunk of one token shares a step with decodes only."""
    model = tiny_model()
    prompts = [[1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13]]
    want = [greedy_reference(model, p, 4) for p in prompts]
    for budget in (1, 3):
        outs = LLMEngine(model, EngineConfig(max_num_batched_tokens=budget)).generate(prompts, greedy(4))
        assert [o.token_ids for o in outs] == want, budget


def test_a_pool_too_small_for_any_request_is_refused_at_construction():
    with pytest.raises(ValueError, match="num_blocks"):
        LLMEngine(tiny_model(), EngineConfig(num_blocks=1, block_size=1, max_num_seqs=1, max_num_batched_tokens=1,
                                             max_model_len=2))
