"""The CPU paged attention kernels, built by ``arbor.kernels.native`` with ``-O3 -march=native
-ffast-math -fopenmp``: decode (``paged_decode.c``, one query per sequence) and prefill
(``paged_prefill.c``, chunks of queries, causal; AVX-512 only). Where one cannot be built the
engine keeps its PyTorch path for it (gather the blocks, then SDPA)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from arbor.kernels import native
from arbor.kernels.threads import thread_budget

SOURCE = Path(__file__).with_name("paged_decode.c")
PREFILL_SOURCE = Path(__file__).with_name("paged_prefill.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@cache
def load_kernel():
    """→ the C function ``paged_decode_attention``, or None when it cannot be built here."""
    lib = native.build(SOURCE, FLAGS)
    if lib is None:
        return None
    fn = lib.paged_decode_attention
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, ctypes.c_long, ptr, ptr, ptr, i32, ptr, i32, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = None
    return fn


@cache
def load_prefill_kernel():
    """→ the C function ``paged_prefill_attention``, or None when it cannot be built or run here."""
    lib = native.build(PREFILL_SOURCE, FLAGS)
    if lib is None or not lib.paged_prefill_available():
        return None
    fn = lib.paged_prefill_attention
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, ctypes.c_long, ptr, ptr, ptr, i32, ptr, i32, ptr, ptr, ptr, i32, i32, i32, i32, i32,
                   ctypes.c_float, i32]
    fn.restype = None
    return fn


def supports_prefill(device, dtype, head_dim: int, block_size: int) -> bool:
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0
            and head_dim <= 256 and block_size % 16 == 0 and load_prefill_kernel() is not None)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, chunks, block_size: int, scale: float, out=None):
    """q [T, Hq, D] (rows may be strided); k/v_cache [slots, Hkv, D] holding every chunk's keys, its own
    included; block_tables [C, W] int32; chunks [3, C] int32 rows (first query row in q, query count,
    tokens cached before the chunk) → ``out`` [T, Hq, D] (contiguous; allocated when None), rows not
    in a chunk left as they were: query i of chunk c attends causally over keys 0..context_c + i of its
    table."""
    T, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    out = torch.empty(T, H, D, dtype=q.dtype) if out is None else out
    c = chunks.shape[1]
    with native.profiled("arbor::paged_prefill_attention"):
        load_prefill_kernel()(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                              int(q.dtype == torch.bfloat16), block_tables.data_ptr(), block_tables.shape[1],
                              chunks[0].data_ptr(), chunks[1].data_ptr(), chunks[2].data_ptr(), c, H,
                              k_cache.shape[1], D, block_size, scale, thread_budget())
    return out


def supports(device, dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load_kernel() is not None


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float,
                           out=None):
    """q [B, Hq, D] (rows may be strided); k/v_cache [slots, Hkv, D] (same dtype as q);
    block_tables [B, W] int32 (rows padded with any block); context_lens [B] int32 → ``out`` [B, Hq, D]
    (contiguous; allocated when None): softmax(scale · q kᵀ) v over keys 0..context_lens[b]−1 of
    each sequence."""
    B, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:   # rows may be spaced (views of a wider tensor), heads not
        q = q.contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype) if out is None else out
    with native.profiled("arbor::paged_decode_attention"):   # visible to torch.profiler
        load_kernel()(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                      int(q.dtype == torch.bfloat16), block_tables.data_ptr(), block_tables.shape[1],
                      context_lens.data_ptr(), B, H, k_cache.shape[1], D, block_size, scale, thread_budget())
    return out
