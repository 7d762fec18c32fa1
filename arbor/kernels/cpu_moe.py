"""Routed MoE experts in bfloat16 on CPU: the C kernel ``moe_experts.c`` (AVX-512 BF16), built by
``arbor.kernels.native`` with ``-O3 -march=native -ffast-math -fopenmp``. Each token runs through its
k experts only, in one call per layer: the engine's path for decode-sized steps, where streaming the
routed experts' weights bounds the step (``cpu_linear.step_costs`` picks it; larger steps go to grouped
GEMMs). Where the kernel cannot be built or the CPU lacks AVX-512 BF16, ``load_kernel()`` is None and
the engine keeps its PyTorch paths (cpu_linear)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from arbor.kernels import native
from arbor.kernels.threads import thread_budget

SOURCE = Path(__file__).with_name("moe_experts.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@cache
def load_kernel():
    """→ the library with ``moe_experts_bf16`` and ``moe_route_experts_bf16``, or None when it cannot be
    built or run here."""
    lib = native.build(SOURCE, FLAGS)
    if lib is None or not lib.moe_experts_bf16_available():
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.moe_experts_bf16.argtypes = [ptr, i32, ptr, ptr, i32, ptr, ptr, i32, i32, i32, ptr, i32]
    lib.moe_route_experts_bf16.argtypes = [ptr, ptr, i32, i32, i32, ptr, ptr, ptr, ptr, i32, i32, i32, ptr, i32]
    lib.moe_experts_bf16.restype = ctypes.c_int
    lib.moe_route_experts_bf16.restype = None
    return lib


def supports(hidden_size: int, intermediate_size: int) -> bool:
    return hidden_size % 16 == 0 and intermediate_size % 16 == 0 and load_kernel() is not None


def pack_vnni(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] → [..., N/16, K/2, 16, 2] bfloat16, contiguous: 16 output columns × 2 inputs
    per 64 bytes, the operand layout of vdpbf16ps."""
    *lead, n, k = w.shape
    return w.detach().to(torch.bfloat16).reshape(*lead, n // 16, 16, k // 2, 2).transpose(-3, -2).contiguous()


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """x [T, D] bf16, ids/weights [T, k], gate_up = pack_vnni([E, 2I, D]), down = pack_vnni([E, D, I])
    → y [T, D] bf16 = Σ_j w_j · E_{ids_j}(x): float32 sums, silu·up rounded to bf16 once (as the
    PyTorch path's), y rounded once."""
    t, d = x.shape
    e, i = gate_up.shape[0], down.shape[2] * 2
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    y = torch.empty(t, d, dtype=torch.bfloat16)
    with native.profiled("arbor::moe_experts_bf16"):
        bad = load_kernel().moe_experts_bf16(x.data_ptr(), t, ids.data_ptr(), w.data_ptr(), ids.shape[1],
                                             gate_up.data_ptr(), down.data_ptr(), e, d, i, y.data_ptr(),
                                             thread_budget())
    if bad:
        raise ValueError(f"expert ids must lie in 0..{e - 1}; got {ids.min().item()}..{ids.max().item()}")
    return y


def route_and_run(x: torch.Tensor, logits: torch.Tensor, top_k: int, norm_topk_prob: bool, gate_up: torch.Tensor,
                  down: torch.Tensor):
    """The router after its GEMM and ``routed_experts`` in one call: x [T, D], logits [T, E] bf16 →
    (y [T, D] bf16, ids [T, k] int64, probs [T, E] float32) as ``MoE.route`` + ``dispatch_experts`` give
    them (softmax in float32, top-k, renormalised when ``norm_topk_prob``, weights rounded to bf16)."""
    t, d = x.shape
    e, i = gate_up.shape[0], down.shape[2] * 2
    x, logits = x.contiguous(), logits.contiguous()
    probs = torch.empty(t, e, dtype=torch.float32)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    y = torch.empty(t, d, dtype=torch.bfloat16)
    with native.profiled("arbor::moe_experts_bf16"):
        load_kernel().moe_route_experts_bf16(x.data_ptr(), logits.data_ptr(), t, top_k, int(norm_topk_prob),
                                             probs.data_ptr(), ids.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                                             e, d, i, y.data_ptr(), thread_budget())
    return y, ids, probs
