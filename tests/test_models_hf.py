"""Arbor's models compute what transformers computes, loading each other's folders."""

import torch

from arbor.models import ModelConfig, VarlenAttention, load_model, save_model
from arbor.models.causal_lm import CausalLM
from tests.conftest import hf_config


def arbor_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] → logits [B, L, V] through one packed varlen call."""
    b, l = ids.shape
    out = model(ids.reshape(-1), VarlenAttention.from_lengths([l] * b))
    return model.logits(out.hidden).reshape(b, l, -1)


def test_arbor_loads_transformers_folder(hf_folder):
    hf, folder = hf_folder
    model = load_model(folder)
    ids = torch.randint(0, 96, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = arbor_logits(model, ids)
    assert (got - ref).abs().max() <= 1e-4


def test_transformers_loads_arbor_folder(tmp_path, kind):
    import transformers as tf
    cfg = ModelConfig.from_hf(hf_config(kind).to_dict() | {"architectures": [
        {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}[kind]]})
    torch.manual_seed(3)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_model(model, tmp_path / "m")
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(ids).logits - arbor_logits(model, ids)).abs().max() <= 1e-4


def test_sharded_save_round_trips(tmp_path):
    cfg = ModelConfig.from_hf(hf_config("qwen3_moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]})
    model = CausalLM(cfg).eval()
    save_model(model, tmp_path / "m", max_shard_bytes=20_000)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "m").glob("model-*.safetensors"))) > 1
    again = load_model(tmp_path / "m")
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
