"""EngineConfig / LLMEngine refuse, at construction and with a ValueError naming the knob, every
setting under which the engine could never run a request (instead of spinning forever)."""

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine
from arbor.models import CausalLM, ModelConfig


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


def test_good_configs_still_build():
    assert EngineConfig(num_blocks=1, block_size=1, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=2)
    assert EngineConfig(device="cpu").check_device() == torch.device("cpu")
