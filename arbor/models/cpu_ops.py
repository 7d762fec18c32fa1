"""Fused bfloat16 CPU versions of RMSNorm and of q/k-norm + RoPE (``cpu_ops.c``) for the engine.

They run only under ``torch.inference_mode()`` (the engine's forwards) on bfloat16 CPU tensors,
where PyTorch spends most of a small decode step dispatching a dozen tiny ops per norm; the
trainer (autograd or ``no_grad``) always takes the PyTorch expressions. Results equal those
expressions except where the float32 sum of squares, taken in another order, rounds to the
other bfloat16 neighbour (~1 element in 10⁵, one bfloat16 step).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from arbor.models import native


@cache
def _lib():
    lib = native.build(Path(__file__).with_name("cpu_ops.c"), ["-O3", "-march=native", "-fopenmp-simd"])
    if lib is None:
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.rms_norm.argtypes = [p, i64, p, p, i64, i32, f32]
    lib.qk_norm_rope.argtypes = [p, i64, p, i64, p, p, p, p, p, i64, i32, i32, i32, i32, f32]
    lib.rms_norm.restype = lib.qk_norm_rope.restype = None
    return lib


def use(x: torch.Tensor) -> bool:
    """Whether the fused op serves this tensor: bfloat16, CPU, inference mode, library built."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and torch.is_inference_mode_enabled()
            and _lib() is not None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit element stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · bf16(rmsnorm(x))`` over the last dim; weight [D] bfloat16."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    _lib().rms_norm(x2.data_ptr(), x2.stride(0), weight.contiguous().data_ptr(), out.data_ptr(), x2.shape[0],
                    x2.shape[1], eps)
    return out.view(x.shape)


def qk_norm_rope(q, k, wq, wk, cos, sin, eps: float):
    """q [T, Hq, D], k [T, Hk, D] (heads contiguous, tokens may be strided), per-head norm weights
    wq, wk [D], cos/sin [T, R] → (q, k) normed then rotated, views of one [T, Hq + Hk, D]."""
    T, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(T, hq + hk, d, dtype=q.dtype)
    _lib().qk_norm_rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), wq.contiguous().data_ptr(),
                        wk.contiguous().data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, hq, hk, d,
                        cos.shape[-1], eps)
    return out.split((hq, hk), 1)
