"""Loads the CPU paged decode-attention kernel (``paged_decode.c``) through ctypes.

The C source is compiled once per machine with the system C compiler (``$CC``, else ``cc``),
``-O3 -march=native -ffast-math -fopenmp`` (then without OpenMP, then without ``-march=native``,
for compilers that lack them), into ``$ARBOR_CACHE`` (default ``~/.cache/arbor``);
the file name hashes the source, the flags and the CPU's feature flags, so a changed kernel or
another CPU builds anew. No compiler, a failed build, or ``ARBOR_CPU_KERNELS=0`` → ``None``,
and the engine keeps its PyTorch path (gather the blocks, then SDPA).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
# compilers without OpenMP (Apple clang) or -march=native get the same kernel, single-threaded / generic
FALLBACK_FLAGS = [[f for f in FLAGS if f != "-fopenmp"], [f for f in FLAGS if f not in ("-fopenmp", "-march=native")]]


def _cpu_id() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@cache
def load_kernel():
    """→ the C function ``paged_decode_attention``, or None when it cannot be built here."""
    if os.environ.get("ARBOR_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler found; CPU decode attention uses the PyTorch path")
        return None
    src = SOURCE.read_bytes()
    key = hashlib.sha1(src + " ".join([cc, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    out = Path(os.environ.get("ARBOR_CACHE", Path.home() / ".cache" / "arbor")) / f"paged_decode_{key}.so"
    try:
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:   # build aside, then rename: atomic
                lib = Path(tmp) / out.name
                for flags in [FLAGS, *FALLBACK_FLAGS]:
                    build = subprocess.run([cc, *flags, str(SOURCE), "-o", str(lib), "-lm"], capture_output=True)
                    if build.returncode == 0:
                        break
                build.check_returncode()
                os.replace(lib, out)
        fn = ctypes.CDLL(str(out)).paged_decode_attention
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("could not build the CPU decode-attention kernel (%s); using the PyTorch path", detail)
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, ctypes.c_long, ptr, ptr, ptr, i32, ptr, i32, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = None
    return fn


def supports(device, dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load_kernel() is not None


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
    """q [B, Hq, D] (rows may be strided); k/v_cache [slots, Hkv, D] (same dtype as q); block_tables [B, W] int32 (rows
    padded with any block); context_lens [B] int32 → [B, Hq, D]: softmax(scale · q kᵀ) v over
    keys 0..context_lens[b]−1 of each sequence."""
    B, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:   # rows may be spaced (views of a wider tensor), heads not
        q = q.contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype)
    load_kernel()(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), int(q.dtype == torch.bfloat16),
                  block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), B, H, k_cache.shape[1], D,
                  block_size, scale, torch.get_num_threads())
    return out
