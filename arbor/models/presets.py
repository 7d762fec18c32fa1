"""Named tiny model shapes for the built-in tasks, tests and benchmarks (random init)."""

from __future__ import annotations

from arbor.models.config import ModelConfig

TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True)
PRESETS = {
    "tiny": dict(architecture="Qwen3ForCausalLM", **TINY),
    "tiny-moe": dict(architecture="Qwen3MoeForCausalLM", **TINY, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=128, norm_topk_prob=True),
    "tiny-hybrid": dict(architecture="Qwen3NextForCausalLM", **TINY, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=128, shared_expert_intermediate_size=128, norm_topk_prob=True,
                        partial_rotary_factor=0.25,
                        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32),
}


def preset_config(name: str, tokenizer) -> ModelConfig:
    """A preset sized to ``tokenizer`` (vocab rounded up to a multiple of 64, its eos/pad ids)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset '{name}'; choose from {sorted(PRESETS)}")
    vocab = -(-tokenizer.vocab_size // 64) * 64
    return ModelConfig(**PRESETS[name], vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)


def moe_shape(hidden=512, experts=16, top_k=2, moe_intermediate=512, layers=4, vocab=2048) -> dict:
    """``ModelConfig`` fields of a Qwen3-MoE of this size (the bench ep / routepack / plan calibrate shape):
    64-wide heads, half as many KV heads, a dense MLP of 2·hidden."""
    heads = max(2, hidden // 64)
    return dict(architecture="Qwen3MoeForCausalLM", vocab_size=vocab, hidden_size=hidden,
                intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads // 2, head_dim=hidden // heads, max_position_embeddings=4096,
                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate,
                norm_topk_prob=True)
