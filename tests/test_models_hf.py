"""Arbor's models compute what transformers computes, loading each other's folders."""

import copy

import torch

from arbor.models import ModelConfig, VarlenAttention, load_model, save_model
from arbor.models.causal_lm import CausalLM
from tests.conftest import ARCHITECTURE, hf_config


def arbor_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] → logits [B, L, V] through one packed varlen call."""
    b, l = ids.shape
    out = model(ids.reshape(-1), VarlenAttention.from_lengths([l] * b))
    return model.logits(out.hidden).reshape(b, l, -1)


def assert_matches(hf_logits, model, ids):
    """transformers' float32 logits (it has no float64 MoE path) against ours in float64, within 10× our
    own float32 rounding of the same forward, measured here (logits ≲ 2.3: 0.9e-6 to 2.4e-5, the
    hybrid the largest; transformers measured 0 to 1.1e-5 off; Qwen2, Llama 3, Mistral: noise 0.6e-6 to
    1e-6, transformers as far off). transformers cast to float64 is still 2.4e-7 to 4.6e-7 off: its RoPE
    frequencies stay the float32 buffers computed at init, so a float64-vs-float64 bound would measure those."""
    exact = arbor_logits(copy.deepcopy(model).double(), ids)
    noise = (arbor_logits(model, ids) - exact).abs().max()
    assert noise > 0 and (hf_logits - exact).abs().max() <= 10 * noise


def test_arbor_loads_transformers_folder(hf_folder):
    hf, folder = hf_folder
    model = load_model(folder)
    ids = torch.randint(0, 96, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_matches(hf(ids).logits, model, ids)


def test_transformers_loads_arbor_folder(tmp_path, family):
    import transformers as tf
    cfg = ModelConfig.from_hf(hf_config(family).to_dict() | {"architectures": [ARCHITECTURE[family]]})
    torch.manual_seed(3)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_model(model, tmp_path / "m")
    again = ModelConfig.from_file(tmp_path / "m")
    assert (again.rope_scaling, again.projection_bias, again.mlp_bias, again.qk_norm) == (
        cfg.rope_scaling, cfg.projection_bias, cfg.mlp_bias, cfg.qk_norm)
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    assert type(hf).__name__ == ARCHITECTURE[family]
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


def test_llama31_rope_scaling_in_the_old_format_gives_transformers_frequencies():
    """A Llama 3.1 config.json as the Hub has it (``rope_scaling`` + top-level ``rope_theta``): Arbor's
    remapped frequencies equal transformers' ``_compute_llama3_parameters`` (float32, same formula and
    operation order: bit-equal), and the config survives a save."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from arbor.models.layers import Rotary
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128, hidden_size=4096,
              intermediate_size=128, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
              max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(
                  factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
                  rope_type="llama3"))
    cfg = ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf(cfg.to_hf()).rope_scaling == cfg.rope_scaling
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](tf.LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"}))
    ours = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling).inv_freq(torch.device("cpu"))
    plain = Rotary(cfg.rotary_dim, cfg.rope_theta).inv_freq(torch.device("cpu"))
    assert scale == 1.0 and torch.equal(ours, theirs)
    assert (ours == plain).any() and (ours == plain / 8).any() and ((ours != plain) & (ours != plain / 8)).any()


def test_loading_a_model_leaves_torch_dynamo_unimported(tmp_path):
    """``load_model`` builds on the meta device without ``nn.Embedding``'s draw (``CausalLM.on_meta``): a
    ``normal_`` on a meta tensor would import torch._dynamo, 0.6 to 1.5 s of the start of `arbor serve`."""
    import subprocess
    import sys
    cfg = ModelConfig.from_hf(hf_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]})
    save_model(CausalLM(cfg), tmp_path / "m")
    code = ("import sys; from arbor.models import load_model; m = load_model(sys.argv[1]); "
            "print(m.model.embed_tokens.weight.device, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "False"]
