"""Tiny HF configs and helpers shared by the model tests."""

import pytest
import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
NEXT = dict(shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)


def hf_config(kind: str):
    import transformers as tf
    if kind == "qwen3":
        return tf.Qwen3Config(**TINY)
    if kind == "qwen3_hd16":   # head_dim a multiple of 16: the CPU prefill kernel's shapes
        return tf.Qwen3Config(**(TINY | dict(head_dim=16)))
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**TINY, **MOE, norm_topk_prob=True)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**TINY, **MOE, **NEXT)
    raise KeyError(kind)


def hf_model(kind: str, seed: int = 0):
    """A transformers model with every weight perturbed away from its structured init."""
    import transformers as tf
    torch.manual_seed(seed)
    cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen3_hd16": tf.Qwen3ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
           "qwen3_next": tf.Qwen3NextForCausalLM}[kind]
    model = cls(hf_config(kind)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(params=["qwen3", "qwen3_moe", "qwen3_next"])
def kind(request):
    return request.param


@pytest.fixture
def hf_folder(tmp_path, kind):
    model = hf_model(kind)
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on a shared 2-core machine run far faster single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
