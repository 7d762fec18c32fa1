"""Arbor's models compute what transformers computes, loading each other's folders."""

import copy

import torch

from arbor.models import ModelConfig, VarlenAttention, load_model, save_model
from arbor.models.causal_lm import CausalLM
from tests.conftest import hf_config


def arbor_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] → logits [B, L, V] through one packed varlen call."""
    b, l = ids.shape
    out = model(ids.reshape(-1), VarlenAttention.from_lengths([l] * b))
    return model.logits(out.hidden).reshape(b, l, -1)


def assert_matches(hf_logits, model, ids):
    """transformers' float32 logits (it has no float64 MoE path) against ours in float64, within 10× our
    own float32 rounding of the same forward, measured here (logits ≲ 2.3: 0.9e-6 to 2.4e-5, the
    hybrid the largest; transformers measured 0 to 1.1e-5 off)."""
    exact = arbor_logits(copy.deepcopy(model).double(), ids)
    noise = (arbor_logits(model, ids) - exact).abs().max()
    assert noise > 0 and (hf_logits - exact).abs().max() <= 10 * noise


def test_arbor_loads_transformers_folder(hf_folder):
    hf, folder = hf_folder
    model = load_model(folder)
    ids = torch.randint(0, 96, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_matches(hf(ids).logits, model, ids)


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
        assert_matches(hf(ids).logits, model, ids)


def test_sharded_save_round_trips(tmp_path):
    cfg = ModelConfig.from_hf(hf_config("qwen3_moe").to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]})
    model = CausalLM(cfg).eval()
    save_model(model, tmp_path / "m", max_shard_bytes=20_000)
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "m").glob("model-*.safetensors"))) > 1
    again = load_model(tmp_path / "m")
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
