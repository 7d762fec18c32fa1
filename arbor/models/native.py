"""Builds a C source next to it into a shared library, once per machine, and loads it (ctypes).

Compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) and the given flags, retried
without OpenMP and then without ``-march=native`` for compilers that lack them (Apple clang),
into ``$ARBOR_CACHE`` (default ``~/.cache/arbor``). The file name hashes the source, the flags
and the CPU's feature flags, so an edited source or another CPU builds anew. No compiler, a
failed build, or ``ARBOR_CPU_KERNELS=0`` → ``None``: callers keep their PyTorch path.
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
from pathlib import Path

log = logging.getLogger(__name__)


def _cpu_id() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def build(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    if os.environ.get("ARBOR_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler found; %s is not built, the PyTorch path runs instead", source.name)
        return None
    flags = [*flags, "-shared", "-fPIC"]
    key = hashlib.sha1(source.read_bytes() + " ".join([cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    out = Path(os.environ.get("ARBOR_CACHE", Path.home() / ".cache" / "arbor")) / f"{source.stem}_{key}.so"
    tries = [flags, [f for f in flags if not f.startswith("-fopenmp")],
             [f for f in flags if not f.startswith("-fopenmp") and f != "-march=native"]]
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
        log.warning("could not build %s (%s); the PyTorch path runs instead", source.name, detail)
        return None
