"""One causal LM assembled from per-layer token mixers and MLPs.

Layer i: ``h = x + mixer_i(norm(x))``, ``x' = h + mlp_i(norm(h))`` with mixer_i = softmax
attention (``full_attention``) or Gated DeltaNet (``linear_attention``) and mlp_i = SwiGLU or MoE
(``cfg.is_moe_layer(i)``). Module names equal HF's (``model.layers.3.self_attn.q_proj``, …) so
checkpoints map one to one.

All inputs are packed: ``input_ids [T]`` holds the tokens of every sequence of the call, and
``attn`` (see ``arbor.models.attention``) says who sees whom. Linear-attention layers take and
return one recurrent state per sequence; MoE layers can return and replay routed expert ids and
return their router probabilities (for a load-balancing loss).
On tree metadata (anything with ``parents``) linear-attention layers run by
``arbor.models.tree_linear`` and return no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from arbor.models.attention import SoftmaxAttention
from arbor.models.config import ModelConfig
from arbor.models.gated_deltanet import GatedDeltaNet, LinearState
from arbor.models.layers import MLP, Linear, RMSNorm, Rotary, recomputed
from arbor.models.moe import MoE
from arbor.models.tree_linear import linear_plan_for, tree_gated_deltanet


@dataclass
class ModelOutput:
    hidden: torch.Tensor                          # [T, D] after the final norm
    states: list[LinearState | None] | None       # per layer; None for softmax layers
    routed_experts: torch.Tensor | None           # [num_moe_layers, T, k] when asked
    router_probs: torch.Tensor | None = None      # [num_moe_layers, T, E] float32 when asked


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.is_linear = cfg.layer_types[i] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        else:
            self.self_attn = SoftmaxAttention(cfg, i)
        self.is_moe = cfg.is_moe_layer(i)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=cfg.is_next)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=cfg.is_next)

    def forward(self, x, cos, sin, attn, state=None, ids=None):
        """→ (x, linear-attention state or None, routed ids or None, router probs or None)."""
        h = self.input_layernorm(x)
        if self.is_linear and getattr(attn, "parents", None) is not None:
            plan = linear_plan_for(attn, self.linear_attn.chunk_size)
            h, state = tree_gated_deltanet(self.linear_attn, h, plan, state), None
        elif self.is_linear:
            if attn.cu_seqlens is None:
                raise ValueError(f"{type(attn).__name__} gives no sequence boundaries, which "
                                 "linear-attention layers need; use VarlenAttention")
            h, state = self.linear_attn(h, attn.cu_seqlens, state)
        else:
            h = self.self_attn(h, cos, sin, attn)
        x = x + h
        h = self.post_attention_layernorm(x)
        probs = None
        if self.is_moe:
            h, ids, probs = self.mlp(h, ids)
        else:
            h = self.mlp(h)
        return x + h, state, ids, probs


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=cfg.is_next)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.gradient_checkpointing = False
        self.apply(self._init_weights)

    @staticmethod
    def on_meta(cfg: ModelConfig) -> "CausalLM":
        """The model of ``cfg`` on the meta device (no memory, no values), for a caller that sets every
        tensor. ``nn.Embedding`` draws its weight at construction, and a ``normal_`` on a meta tensor
        imports torch._dynamo (0.6 to 1.5 s of a process's start): that draw is skipped."""
        init, nn.init.normal_ = nn.init.normal_, lambda t, *a, **k: t
        try:
            with torch.device("meta"):
                return CausalLM(cfg)
        finally:
            nn.init.normal_ = init

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.device.type != "meta":
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, input_ids, attn, positions=None, states=None, routed_experts=None,
                return_routing=False, return_router_probs=False) -> ModelOutput:
        """input_ids [T]; positions [T] (default: ``attn.positions()``); states: per-layer
        LinearState (None = start of sequence); routed_experts [num_moe_layers, T, k] to replay."""
        for _, out in self.forward_segments(input_ids, attn, len(self.model.layers), positions, states,
                                            routed_experts, return_routing, return_router_probs):
            pass
        return out

    def forward_segments(self, input_ids, attn, layers_per_segment: int, positions=None, states=None,
                         routed_experts=None, return_routing=False, return_router_probs=False):
        """``forward`` cut into segments of ``layers_per_segment`` layers — communication-safe boundaries
        for P/D multiplexing (a segment's MoE exchanges are all issued when it returns). A generator:
        each ``next()`` runs one segment and yields ``(layers done, None)``; the last yields
        ``(num_layers, ModelOutput)``, exactly what ``forward`` returns."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be packed 1-D [T], got shape {tuple(input_ids.shape)}")
        if not isinstance(layers_per_segment, int) or layers_per_segment < 1:
            raise ValueError(f"layers_per_segment must be an integer ≥ 1, got {layers_per_segment!r}")
        if positions is None:
            positions = attn.positions()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        layers = self.model.layers
        new_states = [None] * len(layers)
        routed, probs, m = [], [], 0
        for i, layer in enumerate(layers):
            state = states[i] if states is not None else None
            ids = routed_experts[m] if (routed_experts is not None and layer.is_moe) else None
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x, new_states[i], ids, p = recomputed(layer, x, cos, sin, attn, state, ids)
            else:
                x, new_states[i], ids, p = layer(x, cos, sin, attn, state, ids)
            if layer.is_moe:
                routed.append(ids)
                probs.append(p)
                m += 1
            if (i + 1) % layers_per_segment == 0 and i + 1 < len(layers):
                yield i + 1, None
        has_linear = any(layer.is_linear for layer in layers)
        yield len(layers), ModelOutput(
            hidden=self.model.norm(x),
            states=new_states if has_linear else None,
            routed_experts=torch.stack(routed) if ((return_routing or return_router_probs) and routed) else None,
            router_probs=torch.stack(probs) if (return_router_probs and probs) else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
