"""What every benchmark shares: interleaved timing with medians, a ratio table, JSON + PNG output.

Every result JSON says where it came from: ``machine`` (CPU model, ISA flags, cores, memory, torch) and
``run`` (UTC date, the exact command line with the environment variables that change numerics or
threads, the git commit and the files that differed from it, the process's wall time), so that a
figure committed under ``benchmarks/results/`` can be traced and re-run (``arbor bench render``)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                     device="cpu") -> dict[str, list[float]]:
    """Run each fn ``warmup`` times, then ``repeats`` rounds of all fns in turn (so drifting machine
    load hits every system alike); returns the seconds of every timed call per name."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def median(xs) -> float:
    return statistics.median(xs)


# CPU flags worth a line in a result: the vector and matrix extensions the kernels choose between
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve")
# environment variables that change what a bench measures (threads, allocator, kernels, ISA caps)
RUN_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ARBOR_MALLOC", "ARBOR_CPU_KERNELS", "ARBOR_CPU_ARCH",
           "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "CUDA_VISIBLE_DEVICES")


def _cpuinfo(text: str | None = None) -> tuple[str | None, list[str], str | None]:
    """(model name, flags, "family F model M") of the first CPU in /proc/cpuinfo — the x86 family and model
    numbers tell apart CPUs that share a name (a virtual "AMD EPYC" may be a Zen 4 or a Zen 5); (None, [],
    None) where there is no /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text() if text is None else text
    except OSError:
        return None, [], None
    model, flags, ids = None, [], {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value.split()
        elif key in ("cpu family", "model") and key not in ids:
            ids[key] = value.strip()
    cpu_id = f"family {ids['cpu family']} model {ids['model']}" if len(ids) == 2 else None
    return model, flags, cpu_id


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine() -> dict:
    """The machine a result was measured on."""
    model, flags, cpu_id = _cpuinfo()
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": model or platform.processor() or platform.machine(), "cpu_id": cpu_id, "arch": platform.machine(),
            "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "memory_gib": _memory_gib(), "os": platform.platform(terse=True)}
    if hasattr(os, "sched_getaffinity"):
        info["cores_usable"] = len(os.sched_getaffinity(0))
    if hasattr(torch.backends, "cpu") and hasattr(torch.backends.cpu, "get_cpu_capability"):
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user types it: ``arbor …`` however it was started, after the environment
    variables of ``RUN_ENV`` that are set."""
    argv = list(sys.argv if argv is None else argv)
    head = Path(argv[0]).name if argv else "arbor"
    if head in ("arbor", "cli.py", "__main__.py", "-m", "-c") or not argv:
        argv = ["arbor", *argv[1:]]
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RUN_ENV if k in os.environ]
    return " ".join(env + [shlex.join(argv)])


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _process_wall_s() -> float | None:
    """Seconds since this process started (Linux), or None."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 1)
    except (OSError, ValueError, IndexError):
        return None


def run_info() -> dict:
    """When, by which command, at which commit a result was made."""
    commit = _git("rev-parse", "HEAD")
    changed = _git("diff", "--name-only", "HEAD") if commit else None     # tracked files that differ from it
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command_line(), "git_commit": commit,
            "git_changed_files": changed.splitlines() if changed else [],
            "wall_s": _process_wall_s(), "load_avg_1m": None if load is None else round(load, 2)}


def print_table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    text = "\n".join(lines)
    print(text)
    return text


def add_moe_shape_arguments(p) -> None:
    """The Qwen3-MoE shape flags of the expert-parallel benches (defaults: experts dominate the weights)."""
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)


def target(name: str, value: float, wanted: str, met: bool) -> dict:
    """One entry of a bench JSON's ``targets`` list: what its issue asked for, computed from the run."""
    return {"name": name, "value": value, "target": wanted, "met": bool(met)}


def print_targets(targets: list[dict]) -> None:
    print_table("targets", ["target", "value", "wanted", "met"],
                [[t["name"], t["value"], t["target"], "yes" if t["met"] else "NO"] for t in targets])


def write_result(out_dir: str | Path, name: str, result: dict, plot: Callable | None = None) -> Path:
    """Write ``name.json`` (result + ``machine`` + ``run`` + the calling module's docstring as ``description``)
    and, given ``plot(ax_or_fig)``, ``name.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = sys._getframe(1).f_globals.get("__doc__")      # the calling bench module's: what it measures
    result = {"benchmark": name, "description": (doc or "").strip(), "machine": machine(), "run": run_info(), **result}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    if plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = plot(plt)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
        plt.close(fig)
    print(f"wrote {out / name}.json" + (f" and {name}.png" if plot else ""))
    return out / f"{name}.json"
