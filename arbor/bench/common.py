"""What every benchmark shares: interleaved timing with medians, a ratio table, JSON + PNG output."""

from __future__ import annotations

import json
import platform
import statistics
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


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


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
    """Write ``name.json`` (result + machine facts) and, given ``plot(ax_or_fig)``, ``name.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "machine": machine(), **result}
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
