"""Fused CPU versions of RMSNorm, of q/k-norm + RoPE (and RoPE alone) and of SwiGLU's ``silu(g) · u``
(``cpu_ops.c``) for the engine.

They run only under ``torch.inference_mode()`` (the engine's forwards) on CPU tensors, where
PyTorch spends much of a small decode step dispatching a dozen tiny ops per layer; the trainer
(autograd or ``no_grad``) always takes the PyTorch expressions. bfloat16: always in inference
mode; results equal the expressions except where a float32 sum taken in another order rounds to
the other bfloat16 neighbour (~1 element in 10⁵, one bfloat16 step). float32: only on a copy the
engine owns (``owned``, set by ``arbor.engine.cpu_linear.pack_linears``), because a shared float32
model must give the trainer's log-probs bit for bit and these ops sum in another order (last-bit
differences).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from arbor.kernels import native


@cache
def _lib():
    lib = native.build(Path(__file__).with_name("cpu_ops.c"), ["-O3", "-march=native", "-fopenmp-simd"])
    if lib is None:
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.rms_norm.argtypes = lib.rms_norm_f32.argtypes = [p, i64, p, p, i64, i32, f32]
    lib.qk_norm_rope.argtypes = lib.qk_norm_rope_f32.argtypes = [p, i64, p, i64, p, p, p, p, p, i64, i32, i32,
                                                                 i32, i32, f32]
    lib.rope.argtypes = lib.rope_f32.argtypes = [p, i64, p, i64, p, p, p, i64, i32, i32, i32, i32]
    lib.silu_mul.argtypes = lib.silu_mul_f32.argtypes = [p, i64, p, i64, p, i64, i32]
    for fn in (lib.rms_norm, lib.rms_norm_f32, lib.qk_norm_rope, lib.qk_norm_rope_f32, lib.rope, lib.rope_f32,
               lib.silu_mul, lib.silu_mul_f32):
        fn.restype = None
    return lib


def use(x: torch.Tensor, owned: bool = False) -> bool:
    """Whether the fused ops serve this tensor: CPU, inference mode, library built; bfloat16, or
    float32 on an engine-owned copy (``owned``)."""
    return ((x.dtype == torch.bfloat16 or (owned and x.dtype == torch.float32)) and x.device.type == "cpu"
            and torch.is_inference_mode_enabled() and _lib() is not None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit element stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · bf16(rmsnorm(x))`` over the last dim (float32: ``weight · rmsnorm(x)``); weight [D] of x's
    dtype, bfloat16 or float32."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    (_lib().rms_norm_f32 if x.dtype == torch.float32 else _lib().rms_norm)(x2.data_ptr(), x2.stride(0), weight.contiguous().data_ptr(), out.data_ptr(), x2.shape[0],
                    x2.shape[1], eps)
    return out.view(x.shape)


def qk_norm_rope(q, k, wq, wk, cos, sin, eps: float):
    """q [T, Hq, D], k [T, Hk, D] (heads contiguous, tokens may be strided), per-head norm weights
    wq, wk [D], cos/sin [T, R] → (q, k) normed then rotated, views of one [T, Hq + Hk, D];
    bfloat16 or float32, every tensor of one dtype."""
    return _rotate(q, k, cos, sin, (wq, wk, eps))


def rope(q, k, cos, sin):
    """``qk_norm_rope`` without the norm (models without q/k norm): (q, k) rotated, views of one
    [T, Hq + Hk, D]; in bfloat16 equal to ``apply_rope`` bit for bit (no sums)."""
    return _rotate(q, k, cos, sin, None)


def _rotate(q, k, cos, sin, norm):
    """The C op of ``qk_norm_rope`` (``norm`` = (wq, wk, eps)) or of ``rope`` (``norm`` None)."""
    T, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(T, hq + hk, d, dtype=q.dtype)
    lib, f32 = _lib(), q.dtype == torch.float32
    heads = (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0))
    tail = (out.data_ptr(), T, hq, hk, d, cos.shape[-1])
    if norm is None:
        (lib.rope_f32 if f32 else lib.rope)(*heads, cos.data_ptr(), sin.data_ptr(), *tail)
    else:
        wq, wk, eps = norm
        (lib.qk_norm_rope_f32 if f32 else lib.qk_norm_rope)(
            *heads, wq.contiguous().data_ptr(), wk.contiguous().data_ptr(), cos.data_ptr(), sin.data_ptr(), *tail, eps)
    return out.split((hq, hk), 1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for [T, I] rows (unit element stride, rows may be strided: the two
    halves of one fused gate/up GEMM); bfloat16 or float32."""
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype)
    fn = _lib().silu_mul_f32 if gate.dtype == torch.float32 else _lib().silu_mul
    fn(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), gate.shape[0], gate.shape[1])
    return out
