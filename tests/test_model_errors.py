"""Bad configs and bad checkpoints fail with errors that name the key or tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from arbor.models import CausalLM, CheckpointError, ConfigError, ModelConfig, load_model, save_model
from tests.test_model_attention import DENSE, MOE


def hf_dict(cfg: dict) -> dict:
    return ModelConfig(**cfg).to_hf()


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["GemmaForCausalLM"]}, r"'architectures': unsupported architecture 'GemmaForCausalLM'; "
     r"Arbor supports \['ArborBlockDiffusionForCausalLM', 'LlamaForCausalLM', 'MistralForCausalLM', "
     r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', 'Qwen3NextForCausalLM'\]"),
    ({"architectures": []}, "expected one architecture"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"layer_types": ["full_attention"]}, "layer_types.*1 entries but num_hidden_layers=2"),
    ({"layer_types": ["full_attention", "mamba"]}, "unknown layer types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'.*implements \\['default', 'llama3'\\]"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None},
     r"rope_type 'llama3' needs \['low_freq_factor', 'high_freq_factor'\]"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64, "max_position_embeddings": 4096},
     "'sliding_window': 64 < max_position_embeddings=4096: Arbor has no sliding-window attention"),
    ({"architectures": ["Qwen2ForCausalLM"], "layer_types": ["full_attention", "sliding_attention"]},
     "'layer_types': has sliding_attention layers .* Arbor has no sliding-window attention"),
    ({"architectures": ["Qwen2ForCausalLM"], "layer_types": None, "use_sliding_window": True, "max_window_layers": 1},
     "'layer_types': has sliding_attention layers"),
    ({"mlp_bias": True}, "'mlp_bias': only LlamaForCausalLM"),
])
def test_bad_config(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(hf_dict(DENSE) | change)


def test_bad_moe_and_diffusion_config():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf(hf_dict(MOE) | {"num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="mask_token_id"):
        ModelConfig(**(DENSE | dict(architecture="ArborBlockDiffusionForCausalLM", block_size=4)))


@pytest.fixture
def saved(tmp_path):
    model = CausalLM(ModelConfig(**MOE))
    return save_model(model, tmp_path / "m")


def rewrite(folder, edit):
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_tensor(saved):
    rewrite(saved, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.self_attn.k_norm.weight' \(expected shape \[8\]\)"):
        load_model(saved)


def test_missing_expert(saved):
    rewrite(saved, lambda t: t.pop("model.layers.0.mlp.experts.2.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.0.mlp.experts.2.up_proj.weight'"):
        load_model(saved)


def test_extra_tensor(saved):
    rewrite(saved, lambda t: t.update({"model.layers.7.self_attn.q_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.7.self_attn.q_proj.weight'"):
        load_model(saved)


def test_misshaped_tensor(saved):
    rewrite(saved, lambda t: t.update({"model.norm.weight": torch.zeros(31)}))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[31\], expected \[32\]"):
        load_model(saved)


def test_missing_files(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(saved)


def test_config_round_trip(saved):
    cfg = ModelConfig.from_file(saved)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
