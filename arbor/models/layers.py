"""Shared building blocks: RMSNorm, rotary position embedding, SwiGLU MLP.

- RMSNorm: ``y = x / sqrt(mean(x²) + eps) · w`` computed in float32 (float64 for float64 x). Qwen3 casts the
  normalised value back to the input dtype before the product; Qwen3-Next (``zero_centred``) stores ``w`` as
  an offset and computes ``(x̂ · (1 + w))`` in float32 before the cast.
- RoPE (rotate-half form) on the first ``rotary_dim`` channels of each head:
  ``x' = x · cos(pθ) + rotate_half(x) · sin(pθ)``, ``θ_i = base^(-2i / rotary_dim)``.
  Llama 3's ``llama3`` RoPE remaps θ by wavelength λ = 2π/θ against
  L = original_max_position_embeddings: λ < L / high_freq_factor keeps θ, λ > L / low_freq_factor
  takes θ / factor, and in between ``(1 − s) · θ / factor + s · θ`` with
  ``s = (L/λ − low_freq_factor) / (high_freq_factor − low_freq_factor)`` (transformers'
  ``_compute_llama3_parameters``, in the same operation order).
- SwiGLU: ``down(silu(gate(x)) · up(x))`` (Llama's ``mlp_bias``: each projection with a bias).
- Linear: ``nn.Linear`` whose float32 CPU GEMMs run on oneDNN (``arbor.kernels.fp32_gemm``); every
  projection of the models is one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from arbor.kernels import cpu_ops, fp32_gemm, train_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False,
             engine_owned: bool = False) -> torch.Tensor:
    """The RMSNorm above over x's last dim; ``weight`` broadcasts over x's trailing dims ([D], or
    [H, D] for one weight per head). ``engine_owned``: float32 may take the fused C op (``cpu_ops.use``)."""
    fused = not zero_centred and weight.dim() == 1 and weight.dtype == x.dtype
    if fused and cpu_ops.use(x, engine_owned):   # the engine: bf16 CPU, or float32 on its own copy
        return cpu_ops.rms_norm(x, weight, eps)
    if fused and not torch.is_inference_mode_enabled() and train_ops.available(x):   # the trainer, bf16 / f32 CPU
        return train_ops.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and fused:   # one fused call, bit-identical here
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), x.shape[-1:], None, eps)
    if zero_centred:
        return (xf * (1.0 + weight.to(xf.dtype))).type_as(x)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    engine_owned = False   # set on the engine's own CPU copy: float32 may use the fused C op too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centred, self.engine_owned)


class Rotary:
    """cos/sin tables for given positions; holds no parameters (nothing to load or save)."""

    cached = False   # set on the engine's own CPU copy: inference reads the rows of a table (``table``)

    def __init__(self, rotary_dim: int, base: float, scaling: dict | None = None):
        self.rotary_dim = rotary_dim
        self.base = base
        self.scaling = scaling or {}
        self._inv_freq: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if (device, dtype) not in self._inv_freq:
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device)
            inv_freq = 1.0 / (self.base ** (exponent.to(dtype) / self.rotary_dim))
            if self.scaling.get("rope_type") == "llama3":
                inv_freq = llama3_inv_freq(inv_freq, **{k: v for k, v in self.scaling.items() if k != "rope_type"})
            self._inv_freq[device, dtype] = inv_freq
        return self._inv_freq[device, dtype]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → (cos, sin), each [T, rotary_dim]; computed in float32 (float64 for float64)."""
        if self.cached and torch.is_inference_mode_enabled() and positions.numel():
            cos, sin = self.table(int(positions.max()) + 1, positions.device, dtype)
            return cos[positions], sin[positions]
        return self.compute(positions, dtype)

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ct = torch.promote_types(dtype, torch.float32)
        freqs = positions.to(ct)[:, None] * self.inv_freq(positions.device, ct)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def table(self, n: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions 0..m−1 for some m ≥ n, computed by ``compute`` (a
        decode step then costs two row gathers instead of a dozen small ops); grown by doubling."""
        key = (torch.device(device), dtype)
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < n:
            m = max(n, 2 * (have[0].shape[0] if have is not None else 1024))
            with torch.inference_mode():
                have = self._tables[key] = self.compute(torch.arange(m, device=device), dtype)
        return have


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, **_) -> torch.Tensor:
    """Llama 3's remapping of the RoPE frequencies (the module docstring's formula)."""
    old_len = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
    s = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - s) * inv_freq / factor + s * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), smoothed, out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] with R ≤ D: rotate the first R channels, pass the rest."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) with its GEMMs by ``fp32_gemm.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_gemm.linear(x, self.weight, self.bias)


class MLP(nn.Module):
    fused_gate_up = None   # optional x → [gate | up] in one GEMM (the engine's packed CPU copy)
    engine_owned = False   # set on the engine's own CPU copy: float32 may use the fused C ops too

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fused_gate_up(x) if self.fused_gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(silu_mul(gate, up, self.engine_owned))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, engine_owned: bool = False) -> torch.Tensor:
    """SwiGLU's ``silu(gate) · up``; one fused C op in the engine's CPU forwards (``cpu_ops``)."""
    if gate.dim() == 2 and cpu_ops.use(gate, engine_owned):
        return cpu_ops.silu_mul(gate, up)
    return F.silu(gate) * up


def recomputed(fn, *args):
    """``fn(*args)`` under activation recomputation, run in full again in backward: no early stop, so a
    recomputed layer always issues its MoE exchanges, on busy and idle ranks alike."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False)
