"""Builds a C source next to it into a shared library, once per machine, and loads it (ctypes).

Compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) and the given flags, retried
without OpenMP and then without ``-march=native`` for compilers that lack them (Apple clang),
into ``$ARBOR_CACHE`` (default ``~/.cache/arbor``). The file name hashes the source, the flags
and the CPU's feature flags, so an edited source or another CPU builds anew. No compiler, a
failed build, or ``ARBOR_CPU_KERNELS=0`` → ``None``: callers keep their PyTorch path.

``ARBOR_CPU_ARCH`` (default ``native``) is the ``-march`` the kernels are built for: e.g.
``x86-64-v3`` builds them as for an AVX2-only CPU, where the kernels that need AVX-512 report
themselves unavailable and their callers take the PyTorch path (``make test-isa``). A value the
compiler refuses raises ``ValueError`` naming it, instead of silently running without kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def profiled(name: str):
    """``torch.profiler.record_function(name)`` while a torch profiler records (so a C kernel shows up
    under its name), else a no-op context: entering a record_function costs ~6 µs, a sizeable part
    of a small decode step's few-µs kernel calls."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled \
        else contextlib.nullcontext()


def _cpu_id() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def enabled() -> bool:
    """``ARBOR_CPU_KERNELS`` (default 1): 1 builds and uses the C kernels and the oneDNN float32 GEMMs
    (``fp32_gemm``), 0 runs PyTorch's own paths only; anything else raises ValueError."""
    kernels = os.environ.get("ARBOR_CPU_KERNELS", "1")
    if kernels not in ("0", "1"):
        raise ValueError(f"ARBOR_CPU_KERNELS={kernels!r}: must be 1 (build and use the C kernels) or 0 (PyTorch only)")
    return kernels == "1"


def build(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    if not enabled():
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler found; %s is not built, the PyTorch path runs instead", source.name)
        return None
    arch = os.environ.get("ARBOR_CPU_ARCH", "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", arch):
        raise ValueError(f"ARBOR_CPU_ARCH={arch!r} is not a -march value (e.g. native, x86-64-v3, skylake-avx512)")
    flags = [f"-march={arch}" if f == "-march=native" else f for f in flags] + ["-shared", "-fPIC"]
    key = hashlib.sha1(source.read_bytes() + " ".join([cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    out = Path(os.environ.get("ARBOR_CACHE", Path.home() / ".cache" / "arbor")) / f"{source.stem}_{key}.so"
    tries = [flags, [f for f in flags if not f.startswith("-fopenmp")],
             [f for f in flags if not f.startswith("-fopenmp") and f != "-march=native"]]
    if arch != "native":     # a chosen target is never dropped: the build must honour it or fail
        tries = tries[:2]
    try:
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:   # build aside, then rename: atomic
                lib = Path(tmp) / out.name
                for fl in tries:
                    done = subprocess.run([cc, *fl, str(source), "-o", str(lib), "-lm"], capture_output=True)
                    if done.returncode == 0:
                        break
                done.check_returncode()
                os.replace(lib, out)
        return ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else e
        if arch != "native" and isinstance(e, subprocess.CalledProcessError):
            raise ValueError(f"ARBOR_CPU_ARCH={arch!r}: the C compiler could not build {source.name} for it "
                             f"({detail}); use a -march value it knows, or unset ARBOR_CPU_ARCH") from None
        log.warning("could not build %s (%s); the PyTorch path runs instead", source.name, detail)
        return None
