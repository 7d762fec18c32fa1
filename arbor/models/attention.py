"""Softmax attention and the metadata objects that say which keys each query sees.

The model never builds masks itself: every forward receives one metadata object whose
``attend(layer_idx, q, k, v, scale)`` maps ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` (the packed
tokens of this call) to ``[T, Hq, D]``. The kinds here:

- ``VarlenAttention(cu_seqlens)``: packed sequences, causal inside each, nothing across.
- ``TreeAttention(parents)``: a token sees itself and its ancestors (parents[i] < i, −1 = root);
  its position is its depth. A root-to-leaf path computes exactly what the path alone computes.
- ``BlockDiffusionAttention(cu_seqlens, block_size)``: a token in block b = position // block_size
  sees every token of its sequence in blocks ≤ b (bidirectional inside a block, causal across).

The engine adds a paged-KV kind behind the same method. ``cu_seqlens`` (sequence boundaries in
token order) is what linear-attention layers read; a kind without it cannot run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from arbor.kernels import cpu_ops, train_ops
from arbor.models.block_attention import BLOCK, block_attention
from arbor.models.layers import Linear, RMSNorm, apply_rope, rms_norm


def sdpa(q, k, v, scale, mask=None, causal=False):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] → [B, T, Hq, D] (GQA by head groups), in q's dtype; mask: bool
    [T, S] (True = attend) or None. On CPU in inference mode (the engine), bfloat16/float16 inputs are
    attended in float32: PyTorch's CPU flash kernel has no fast reduced-precision path for one-query
    decode, and float32 only rounds once, at the output. On CPU outside inference mode (training), ≥
    ``BLOCK`` queries of a non-float64 model with heads of ≥ 128 go to ``block_attention`` (one causal layer
    of 4 × 512 tokens, 8 / 4 heads of 128, fwd + bwd against the flash kernel, AMD EPYC Zen 4, 2 threads:
    0.85× the time in float32, 0.61× in bfloat16); other bfloat16 inputs take PyTorch's bfloat16 flash
    kernel as they are (float32 sums, probabilities rounded to bfloat16 for P·V, as transformers' SDPA
    path and FlashAttention do: 0.94× the time of the float32 upcast for a tiny Qwen3 fwd + bwd). Under CPU
    autocast (``dtype=bfloat16`` training) q, k, v are first cast to autocast's dtype, as autocast casts
    SDPA's inputs."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu") and not torch.is_inference_mode_enabled():
        low = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(low), k.to(low), v.to(low)
    dtype = q.dtype
    if (q.device.type == "cpu" and dtype != torch.float64 and q.shape[1] >= BLOCK and q.shape[-1] >= 128
            and not torch.is_inference_mode_enabled() and (q.shape[1] == k.shape[1] or not causal)
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 2))):
        return block_attention(q, k, v, scale, mask, causal)
    upcast = dtype == torch.float16 or (dtype == torch.bfloat16 and torch.is_inference_mode_enabled())
    if q.device.type == "cpu" and upcast:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).to(dtype)


def cu_seqlens_from_lengths(lengths, device=None) -> torch.Tensor:
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int64, device=device)


@dataclass
class VarlenAttention:
    cu_seqlens: torch.Tensor
    lengths: list[int] = field(init=False)

    def __post_init__(self):
        self.lengths = self.cu_seqlens.diff().tolist()
        if min(self.lengths, default=1) <= 0:
            raise ValueError(f"cu_seqlens must be strictly increasing, got {self.cu_seqlens.tolist()}")

    @classmethod
    def from_lengths(cls, lengths, device=None) -> "VarlenAttention":
        return cls(cu_seqlens_from_lengths(lengths, device))

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def positions(self) -> torch.Tensor:
        """0, 1, … inside each sequence."""
        return torch.cat([torch.arange(n, device=self.cu_seqlens.device) for n in self.lengths])

    def attend(self, layer_idx, q, k, v, scale):
        n = len(self.lengths)
        if all(length == self.lengths[0] for length in self.lengths):
            shape = lambda x: x.reshape(n, self.lengths[0], *x.shape[1:])
            return sdpa(shape(q), shape(k), shape(v), scale, causal=True).reshape(q.shape)
        starts = self.cu_seqlens[:-1].tolist()
        return torch.cat([sdpa(q[None, s:s + m], k[None, s:s + m], v[None, s:s + m], scale, causal=True)[0]
                          for s, m in zip(starts, self.lengths)])


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [T] (−1 = root, parents[i] < i) → bool [T, T], True where j is i or an ancestor of i."""
    t = parents.shape[0]
    if t and bool((parents >= torch.arange(t, device=parents.device)).any()):
        raise ValueError("tree parents must point to earlier tokens (parents[i] < i) or be -1")
    rows = torch.arange(t, device=parents.device)
    mask = torch.zeros(t, t, dtype=torch.bool, device=parents.device)
    node = rows.clone()
    alive = torch.ones(t, dtype=torch.bool, device=parents.device)
    while bool(alive.any()):
        mask[rows[alive], node[alive]] = True
        node = torch.where(alive, parents[node.clamp(min=0)], node)
        alive = alive & (node >= 0)
    return mask


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each token (root = 0): the position id a token has on its root-to-leaf path."""
    return ancestor_mask(parents).sum(-1) - 1


@dataclass
class TreeAttention:
    parents: torch.Tensor
    mask: torch.Tensor = field(init=False)
    cu_seqlens = None

    def __post_init__(self):
        self.mask = ancestor_mask(self.parents)

    @property
    def num_tokens(self) -> int:
        return self.parents.shape[0]

    def positions(self) -> torch.Tensor:
        return self.mask.sum(-1) - 1

    def attend(self, layer_idx, q, k, v, scale):
        return sdpa(q[None], k[None], v[None], scale, mask=self.mask)[0]


@dataclass
class BlockDiffusionAttention:
    cu_seqlens: torch.Tensor
    block_size: int
    lengths: list[int] = field(init=False)

    def __post_init__(self):
        self.lengths = self.cu_seqlens.diff().tolist()

    @classmethod
    def from_lengths(cls, lengths, block_size, device=None) -> "BlockDiffusionAttention":
        return cls(cu_seqlens_from_lengths(lengths, device), block_size)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(n, device=self.cu_seqlens.device) for n in self.lengths])

    def block_mask(self, length: int) -> torch.Tensor:
        """bool [L, L]: query i sees key j iff block(j) ≤ block(i)."""
        block = torch.arange(length, device=self.cu_seqlens.device) // self.block_size
        return block[None, :] <= block[:, None]

    def attend(self, layer_idx, q, k, v, scale):
        starts = self.cu_seqlens[:-1].tolist()
        return torch.cat([sdpa(q[None, s:s + m], k[None, s:s + m], v[None, s:s + m], scale,
                                mask=self.block_mask(m))[0] for s, m in zip(starts, self.lengths)])


class SoftmaxAttention(nn.Module):
    """Qwen3 attention: q/k RMSNorm per head (none in Qwen2, Llama, Mistral), RoPE, GQA. ``gated``
    (Qwen3-Next): q_proj also yields a per-channel gate and the output is ``o_proj(attn · sigmoid(gate))``.
    Biases of the projections: ``ModelConfig.projection_bias``."""

    fused_qkv = None   # optional x → [q | k | v] in one GEMM (the engine's packed CPU copy), see cpu_linear
    engine_owned = False   # set on the engine's own CPU copy: float32 may use the fused C ops too

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.gated = cfg.is_next
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.scale = self.head_dim ** -0.5
        q_out = self.num_heads * self.head_dim * (2 if self.gated else 1)
        qkv_bias, o_bias = cfg.projection_bias
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centred=cfg.is_next)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centred=cfg.is_next)

    def norm_and_rotate(self, q, k, cos, sin):
        """q_norm / k_norm (where the family has them), then RoPE, as one norm and one rotation over
        the heads of both."""
        hq, hk, d = q.shape[1], k.shape[1], self.head_dim
        if self.q_norm is None:
            if q.dtype == cos.dtype and cpu_ops.use(q, self.engine_owned):
                return cpu_ops.rope(q, k, cos, sin)
            return apply_rope(torch.cat((q, k), 1), cos, sin).split((hq, hk), 1)
        wq, wk = self.q_norm.weight, self.k_norm.weight
        if not self.q_norm.zero_centred and wq.dtype == q.dtype == cos.dtype and cpu_ops.use(q, self.engine_owned):
            return cpu_ops.qk_norm_rope(q, k, wq, wk, cos, sin, self.q_norm.eps)
        if (not self.q_norm.zero_centred and not torch.is_inference_mode_enabled()
                and train_ops.available(q, k, wq, wk, cos, sin)):            # the trainer, bf16 / float32 CPU
            return train_ops.qk_norm_rope(q, k, wq, wk, cos, sin, self.q_norm.eps).split((hq, hk), 1)
        weight = torch.cat((wq.expand(hq, d), wk.expand(hk, d)))
        qk = rms_norm(torch.cat((q, k), 1), weight, self.q_norm.eps, self.q_norm.zero_centred)
        return apply_rope(qk, cos, sin).split((hq, hk), 1)

    def forward(self, x, cos, sin, attn):
        t = x.shape[0]
        if self.fused_qkv is not None:
            q, k, v = self.fused_qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, -1)
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.norm_and_rotate(q, k, cos, sin)
        out = attn.attend(self.layer_idx, q, k, v, self.scale).reshape(t, -1)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)
