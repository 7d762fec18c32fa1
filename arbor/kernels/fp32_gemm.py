"""Float32 GEMMs on CPU through oneDNN's matmul, forward and backward.

PyTorch's CPU float32 ``torch.mm`` / ``F.linear`` call MKL's sgemm, which on AMD CPUs runs its AVX2
code; oneDNN picks its kernels by ISA (AVX-512 where there is one). Measured on an AMD EPYC (Zen 5,
2 threads, ``torch.ops.mkldnn._linear_pointwise`` with plain weights, no packing): 490–500 GFLOP/s
against MKL's 215–225 at the GEMMs of a training step (256–2048 rows, K and N 512–1024, either
operand transposed), but ~16 µs per call, so below ``MIN_MACS`` multiply-adds (M·K·N) MKL stays
(0.24× at 1 × 128 × 384, even at 32 × 128 × 512, 1.3× at 256 × 128 × 128). bfloat16 already goes
to oneDNN in PyTorch and is left alone; float64, other devices and autocast regions keep PyTorch's
path; ``ARBOR_CPU_KERNELS=0`` turns this off with the C kernels. Results are float32 GEMMs
(float32 products, float32 sums) in another summation order than MKL's.

oneDNN builds a kernel per shape (~0.35 ms, then cached): callers whose row counts change every step
pad them to a few sizes (``arbor.models.moe.PAD_ROWS``).
"""

from __future__ import annotations

import torch

from arbor.kernels.native import enabled

MIN_MACS = 1 << 21


def active(x: torch.Tensor) -> bool:
    """Whether float32 GEMMs on ``x`` go to oneDNN (those of at least ``MIN_MACS`` multiply-adds)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu") and _onednn()


def serves(a: torch.Tensor, b: torch.Tensor, macs: int) -> bool:
    """Whether oneDNN runs a CPU GEMM of ``macs`` multiply-adds on operands ``a``, ``b``."""
    return macs >= MIN_MACS and b.dtype == torch.float32 and active(a)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] (any strides), not differentiable: oneDNN where it serves, else ``torch.mm``."""
    if serves(a, b, a.shape[0] * a.shape[1] * b.shape[1]):
        return torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")
    return torch.mm(a, b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, cast to ``out``'s dtype (oneDNN has no ``out=``: its result is copied into ``out``)."""
    if out.dtype != a.dtype or serves(a, b, a.shape[0] * a.shape[1] * b.shape[1]):
        out.copy_(mm(a, b))
    else:
        torch.mm(a, b, out=out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; float32 CPU GEMMs above ``MIN_MACS`` by oneDNN, backward too."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not serves(x, weight, rows * weight.shape[0] * weight.shape[1]):
        return torch.nn.functional.linear(x, weight, bias)
    return OneDnnLinear.apply(x, weight, bias)


class OneDnnLinear(torch.autograd.Function):
    """y = x Wᵀ + b on x [..., K] as rows [R, K]; backward ∂x = ∂y W, ∂W = ∂yᵀ x, ∂b = Σ_rows ∂y, each
    GEMM by ``mm`` (oneDNN where it serves)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        rows, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dy = dy.reshape(-1, dy.shape[-1])
        dx = mm(dy, weight).view(ctx.shape) if need_x else None
        dw = None
        if need_w:   # oneDNN copies a transposed first operand: transpose the narrower one (∂W = (xᵀ ∂y)ᵀ)
            dw = mm(dy.t(), rows) if dy.shape[1] <= rows.shape[1] else mm(rows.t(), dy).t().contiguous()
        return dx, dw, dy.sum(0) if need_b else None


_available: bool | None = None


def _onednn() -> bool:
    global _available
    if _available is None:
        _available = (enabled() and torch.backends.mkldnn.is_available()
                      and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _available
