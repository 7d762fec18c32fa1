"""Linears for decode-sized steps on CPU: the C kernel ``small_linear.c`` (AVX-512; vdpbf16ps for
bfloat16), built by ``arbor.kernels.native`` with ``-O3 -march=native -ffast-math -fopenmp``.

``pack(w)`` lays a weight [N, K] out for it once (bfloat16: [N/16, K/2, 16, 2]; float32:
[N/16, K, 16]); ``linear(x, packed, bias)`` = ``F.linear(x, w, bias)`` with float32 sums in k order
and one rounding: in float32 last-bit differences from ``F.linear``, in bfloat16 at most one
bfloat16 step where a sum lies near a rounding boundary (oneDNN and MKL block the k sum). The engine
(``arbor.engine.cpu_linear``) calls it for steps of at most ``MAX_ROWS`` rows, where it measured
faster than oneDNN's packed GEMM (``arbor bench engine --shape 0.6b``); larger steps stay on oneDNN.
Where it cannot be built or the CPU lacks AVX-512 (AVX-512 BF16 for bfloat16), ``supports`` is False.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from arbor.kernels import native
from arbor.kernels.threads import thread_budget

SOURCE = Path(__file__).with_name("small_linear.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
MAX_ROWS = 64   # rows per call it serves: 1.1–1.4× oneDNN up to 64, equal at 80–96, slower beyond (AMD EPYC)


@cache
def load_kernel():
    """→ the library with ``small_linear_f32`` / ``small_linear_bf16``, or None when it cannot be built."""
    lib = native.build(SOURCE, FLAGS)
    if lib is None:
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    for name in ("f32", "bf16"):      # each exists only where the CPU has its instructions
        if getattr(lib, f"small_linear_{name}_available")():
            fn = getattr(lib, f"small_linear_{name}")
            fn.argtypes = [ptr, i32, i32, ptr, ptr, i32, ptr, i32]
            fn.restype = ctypes.c_int
    return lib


@cache
def supports(dtype: torch.dtype) -> bool:
    lib = load_kernel()
    if lib is None or dtype not in (torch.float32, torch.bfloat16):
        return False
    return bool(lib.small_linear_bf16_available() if dtype == torch.bfloat16 else lib.small_linear_f32_available())


def packable(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return n % 16 == 0 and (weight.dtype != torch.bfloat16 or k % 2 == 0) and supports(weight.dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] → the kernel's layout (contiguous copy): 16 output columns side by side per input."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        return w.reshape(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
    return w.reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (x's dtype = the packed weight's), packed = ``pack(w)`` of w [N, K] → x wᵀ + bias [..., N]."""
    k = x.shape[-1]
    n = packed.shape[0] * 16
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    fn = load_kernel().small_linear_bf16 if x.dtype == torch.bfloat16 else load_kernel().small_linear_f32
    b = None if bias is None else bias.detach().to(x.dtype).contiguous()
    if fn(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), None if b is None else b.data_ptr(), n,
          out.data_ptr(), thread_budget()):
        raise MemoryError("small_linear: could not allocate the transposed rows")
    return out.view(*x.shape[:-1], n)
