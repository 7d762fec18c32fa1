"""glibc malloc settings for Arbor's processes: freed memory is kept for reuse, not faulted in again.

glibc by default returns every freed block of M_MMAP_THRESHOLD or more (128 KiB, adapting up to
32 MiB) to the kernel, and trims the heap's top above M_TRIM_THRESHOLD (128 KiB). A training step
frees and re-allocates the same activations and gradients, so each step faults those pages in
again and the kernel zeroes every one (tens of thousands of minor faults per step at the bench ep
shape), and two ranks faulting at once contend for the kernel's page allocator: the slowdown of a
slot where both ranks work, which RoutePack's balanced slots create (docs/routepack.md).

``tune_allocator()`` sets M_MMAP_MAX = 0 (no block is its own mapping: above 32 MiB, glibc's largest
M_MMAP_THRESHOLD, every block would be one, as an MoE layer's expert gradients are — 128 MiB at 32
experts of 1024 × 1024 — and be faulted in again every step: 8 % of a moe32 float32 fwd + bwd, AMD
EPYC Zen 4), M_TRIM_THRESHOLD = 0 and M_TOP_PAD = 256 MiB: every block comes from the heap and returns
to it, and a trim (glibc checks at every large free) gives back only the heap top beyond the 256 MiB
pad. Where the heap cannot grow, glibc still maps a block. Cost: a process keeps freed heap below its
top (where the next step's blocks go again) plus up to 256 MiB on top. (mallopt takes a C int: the
values must fit one; 4 GiB would wrap to 0.) ``ARBOR_MALLOC=system`` keeps glibc's defaults.
``ARBOR_MALLOC=lean`` is for jobs short of memory: mmap on again with M_MMAP_THRESHOLD = 64 KiB, so every
tensor above it is its own mapping, returned to the kernel when freed — resident memory is then the live tensors, with
none of the heap's holes (measured at Qwen3-0.6B's shape, 2048 tokens: 2–3 GiB less peak RSS, 5.7
against 7.9 GiB for bf16 + LoRA), at the price of faulting those pages in again every step (steps took
1.5–2.2× as long on 2 cores). Any other value is refused. A no-op where the C library is not glibc.
Called at the start of every ``arbor`` command and of every rank (``init_distributed``).
``switch_to_lean()`` changes a running process from ``tuned`` to ``lean`` (the training jobs' memory
plan does, when the job fits only without the heap's slack and ``ARBOR_MALLOC`` was not set).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4     # glibc's <malloc.h>
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 0), (M_TOP_PAD, 256 << 20))
LEAN = ((M_MMAP_MAX, 65536), (M_MMAP_THRESHOLD, 64 << 10))          # 65536: glibc's default M_MMAP_MAX
CHOICES = ("tuned", "system", "lean")


_switched = False                      # switch_to_lean() ran in this process


def allocator_mode() -> str:
    if _switched:
        return "lean"
    mode = os.environ.get("ARBOR_MALLOC", "tuned")
    if mode not in CHOICES:
        raise ValueError(f"ARBOR_MALLOC={mode!r}: expected one of {', '.join(CHOICES)} "
                         "(tuned: keep freed memory for reuse; system: glibc's defaults; lean: return it at once)")
    return mode


def tune_allocator() -> bool:
    """Apply the settings above once per process; → whether glibc took them (False: ``system``, or no
    glibc)."""
    mode = allocator_mode()
    if mode == "system" or platform.libc_ver()[0] != "glibc":
        return False
    return _mallopt(LEAN if mode == "lean" else SETTINGS)


def _mallopt(settings) -> bool:
    """Apply glibc ``mallopt`` (parameter, value) pairs; → whether glibc took every one."""
    libc = ctypes.CDLL("libc.so.6")
    return all(libc.mallopt(ctypes.c_int(k), ctypes.c_int(v)) == 1 for k, v in settings)


def switch_to_lean() -> bool:
    """From now on return freed blocks at once (``lean``) and give back the heap's free pages; → whether
    the process changed (False: ``ARBOR_MALLOC`` was set by the user, it already is lean, or no glibc)."""
    global _switched
    if "ARBOR_MALLOC" in os.environ or _switched or platform.libc_ver()[0] != "glibc":
        return False
    _switched = _mallopt(LEAN)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _switched
