"""Model configuration read from (and written back to) an HF ``config.json``.

Supported ``architectures``:

- ``Qwen3ForCausalLM`` — dense: softmax attention (q/k RMSNorm, GQA, RoPE) + SwiGLU.
- ``Qwen3MoeForCausalLM`` — as Qwen3, with top-k MoE MLPs on every ``decoder_sparse_step``-th
  layer not in ``mlp_only_layers``.
- ``Qwen3NextForCausalLM`` — hybrid: ``layer_types`` mixes ``linear_attention`` (Gated DeltaNet)
  and ``full_attention`` (softmax attention with a sigmoid output gate, partial RoPE); MoE with a
  gated shared expert; zero-centred RMSNorm ``y = x̂ · (1 + w)``.
- ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5) — dense, no q/k norm, q/k/v projections with bias (o_proj
  without).
- ``LlamaForCausalLM`` (Llama 3.x) — dense, no q/k norm; ``attention_bias`` (q/k/v/o), ``mlp_bias``,
  RoPE of type ``default`` or ``llama3`` (frequencies remapped by ``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``; see ``arbor.models.layers.Rotary``).
- ``MistralForCausalLM`` — as Llama without biases. Arbor has no sliding-window attention: a
  ``sliding_window`` smaller than ``max_position_embeddings`` is refused.
- ``ArborBlockDiffusionForCausalLM`` (``model_type = "arbor_block_diffusion"``) — Arbor's
  block-diffusion LLM: the Qwen3 layers (dense, or MoE when ``num_experts > 0``) with attention
  bidirectional inside a block of ``block_size`` positions and causal across blocks. Extra keys:
  ``mask_token_id`` (the id a masked position holds) and ``block_size``.

Invariant: ``ModelConfig.from_hf(cfg.to_hf())`` round-trips, and ``to_hf()`` keeps every key of
the source file that Arbor does not interpret, so a saved folder loads where it came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "ArborBlockDiffusionForCausalLM": "arbor_block_diffusion",
}
NO_QK_NORM = ("qwen2", "llama", "mistral")   # model types whose attention has no q/k RMSNorm
ROPE_TYPES = {"default": (),   # → the keys each needs
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
LAYER_TYPES = ("full_attention", "linear_attention")


def torch_dtypes() -> dict:
    """The dtype names a user may give (engine, trainer, bench) → torch dtypes: the one table."""
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A config.json that Arbor cannot build a model from; the message says which key and why."""


@dataclass
class ModelConfig:
    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict = field(default_factory=dict)   # {} (default RoPE) or {"rope_type": "llama3", …}
    layer_types: list[str] = field(default_factory=list)
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0
    # linear attention (Gated DeltaNet)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # block diffusion
    mask_token_id: int | None = None
    block_size: int = 0
    # special tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    # ---- derived properties -------------------------------------------------------------
    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def is_next(self) -> bool:
        """Qwen3-Next conventions: gated attention, (1 + w) norms, shared expert."""
        return self.architecture == "Qwen3NextForCausalLM"

    @property
    def is_block_diffusion(self) -> bool:
        return self.architecture == "ArborBlockDiffusionForCausalLM"

    @property
    def family(self) -> str:
        """``block_diffusion`` or ``autoregressive``: the key of ``arbor.families.FAMILIES`` that
        decides which engine, trainer and server backend serve this model."""
        return "block_diffusion" if self.is_block_diffusion else "autoregressive"

    @property
    def qk_norm(self) -> bool:
        """Per-head q/k RMSNorm before RoPE (the Qwen3 families), absent in Qwen2, Llama, Mistral."""
        return self.model_type not in NO_QK_NORM

    @property
    def projection_bias(self) -> tuple[bool, bool]:
        """(q/k/v projections, o_proj) have a bias: Qwen2 always (q/k/v only), Mistral never."""
        if self.model_type == "qwen2":
            return True, False
        if self.model_type == "mistral":
            return False, False
        return self.attention_bias, self.attention_bias

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def stop_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, key: str, why: str):
            if not ok:
                raise ConfigError(f"config key '{key}': {why}")

        need(self.architecture in ARCHITECTURES, "architectures",
             f"unsupported architecture '{self.architecture}'; Arbor supports {sorted(ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim"):
            need(getattr(self, key) > 0, key, f"must be a positive integer, got {getattr(self, key)}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"num_attention_heads={self.num_attention_heads} must be a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        need("sliding_attention" not in self.layer_types, "layer_types", "has sliding_attention layers (from "
             "use_sliding_window / max_window_layers); Arbor has no sliding-window attention")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        need(not bad, "layer_types", f"unknown layer types {bad}; expected {list(LAYER_TYPES)}")
        need(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim, "partial_rotary_factor",
             f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even and in (0, head_dim]")
        need(not self.mlp_bias or self.model_type == "llama", "mlp_bias", "only LlamaForCausalLM has MLP biases")
        rope_type = self.rope_scaling.get("rope_type", "default")
        need(rope_type in ROPE_TYPES, "rope_parameters",
             f"rope_type '{rope_type}' is not supported; Arbor implements {sorted(ROPE_TYPES)}")
        missing = [k for k in ROPE_TYPES.get(rope_type, ()) if k not in self.rope_scaling]
        need(not missing, "rope_parameters", f"rope_type '{rope_type}' needs {missing}")
        window = self.extra.get("sliding_window")
        need(self.model_type != "mistral" or window is None or window >= self.max_position_embeddings,
             "sliding_window", f"{window} < max_position_embeddings={self.max_position_embeddings}: Arbor has no "
             "sliding-window attention (a window covering max_position_embeddings, or null, is accepted)")
        if "linear_attention" in self.layer_types:
            need(self.is_next, "layer_types", "linear_attention layers need Qwen3NextForCausalLM")
            for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim"):
                need(getattr(self, key) > 0, key, "must be positive when linear_attention layers exist")
            need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
                 f"{self.linear_num_value_heads} must be a multiple of linear_num_key_heads="
                 f"{self.linear_num_key_heads}")
        if self.architecture == "Qwen3MoeForCausalLM" or self.num_experts > 0:
            need(self.num_experts > 0, "num_experts", "an MoE architecture needs num_experts > 0")
            need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 f"must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive for MoE")
            need(self.decoder_sparse_step > 0, "decoder_sparse_step", "must be positive")
        if self.moe_layers and not self.is_next:
            need(self.shared_expert_intermediate_size == 0, "shared_expert_intermediate_size",
                 "a shared expert exists only in Qwen3NextForCausalLM")
        if len(self.moe_layers) < self.num_hidden_layers or self.is_next:
            need(self.intermediate_size > 0, "intermediate_size", "dense MLP layers need it positive")
        if self.is_block_diffusion:
            need(self.block_size > 0, "block_size", "block diffusion needs block_size > 0")
            need(self.mask_token_id is not None and 0 <= self.mask_token_id < self.vocab_size,
                 "mask_token_id", f"must be an id in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}")

    # ---- HF config.json -----------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ConfigError(f"config key 'architectures': expected one architecture, got {archs!r}; "
                              f"Arbor supports {sorted(ARCHITECTURES)}")
        names = {f.name for f in fields(cls)} - {"architecture", "extra"}
        kw = {k: hf[k] for k in names if k in hf and hf[k] is not None}
        if "num_experts" not in kw and hf.get("num_local_experts"):
            kw["num_experts"] = hf["num_local_experts"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"config key 'rope_parameters': rope_type '{rope_type}' is not supported; "
                              f"Arbor implements {sorted(ROPE_TYPES)}")
        kw["rope_scaling"] = {} if rope_type == "default" else {
            "rope_type": rope_type, "original_max_position_embeddings": hf.get("max_position_embeddings"),
            **{k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}}
        kw["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        kw["partial_rotary_factor"] = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config key 'hidden_act': '{hf['hidden_act']}' is not supported; Arbor implements silu")
        if "head_dim" not in kw:
            kw["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        if hf.get("use_sliding_window") and "layer_types" not in kw:   # Qwen2/Qwen3 files without layer_types
            first = hf.get("max_window_layers", 0)
            kw["layer_types"] = ["sliding_attention" if i >= first else "full_attention"
                                 for i in range(hf.get("num_hidden_layers", 0))]
        if kw.get("mlp_only_layers") is None:
            kw["mlp_only_layers"] = []
        try:
            return cls(architecture=archs[0], extra=dict(hf), **kw)
        except TypeError as e:
            raise ConfigError(f"config.json has a value of the wrong type: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        from arbor.models.lora import adapter_base, is_adapter_folder
        path = Path(path)
        if path.is_dir():
            path = (adapter_base(path) if is_adapter_folder(path) else path) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); an HF model folder's config.json is a JSON object") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds {type(data).__name__}, not a JSON object of model settings")
        try:
            return cls.from_hf(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf(self) -> dict:
        out = dict(self.extra)
        for f in fields(self):
            if f.name in ("architecture", "extra", "rope_theta", "partial_rotary_factor", "rope_scaling"):
                continue
            out[f.name] = getattr(self, f.name)
        if not self.is_block_diffusion:
            out.pop("mask_token_id", None), out.pop("block_size", None)
        if self.num_experts == 0:
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                      "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"):
                out.pop(k, None)
        if "linear_attention" not in self.layer_types:
            for k in [k for k in out if k.startswith("linear_")]:
                out.pop(k)
        out.pop("num_local_experts", None)
        out.pop("rope_theta", None), out.pop("rope_scaling", None)
        if self.model_type != "llama":
            out.pop("mlp_bias", None)
        if self.model_type in ("llama", "mistral"):   # no layer_types there (transformers reads it as Ministral)
            out.pop("layer_types", None)
        out["architectures"] = [self.architecture]
        out["model_type"] = self.model_type
        rope = {"rope_type": "default", **self.rope_scaling, "rope_theta": self.rope_theta}
        if self.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        out["rope_parameters"] = rope
        out["hidden_act"] = "silu"
        return out
