"""Start-up cost of a sandboxed run (`arbor bench sandbox`): the wall time of ``run_python("print(1)")``,
from the call to the result, for the sandbox before and after its filesystem view.

Systems, each in its own child process (a sandbox's probes are cached per process), run in turn for
`--rounds` rounds of `--runs` calls each, so drifting load hits them alike:

- `before`: the sandbox at `--baseline` (default: the commit before the filesystem view), its
  ``arbor/rollout/sandbox*.py`` taken with ``git archive``: unshare namespaces, private tmpfs, the
  host's filesystem readable;
- `bwrap`, `unshare`: today's sandbox with ``isolation=bwrap`` / ``unshare`` (a minimal read-only root,
  `arbor.rollout.sandbox_view`); those that do not work here are reported as missing;
- `none`: weak isolation (rlimits and the prelude only), the floor any sandbox pays.

Reported: median and p90 per system and each median's ratio to `before`'s. Target: a run in the
default isolation (`auto`: bwrap where it works, else unshare) costs ≤ 1.5× `before`'s median.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from arbor.bench.common import median, print_table, print_targets, target, write_result

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "cd46a78"        # the last commit whose sandbox showed the host's filesystem
SYSTEMS = ("before", "bwrap", "unshare", "none")
_FILES = ("arbor/__init__.py", "arbor/configs.py", "arbor/rollout")     # all a sandbox module imports

_CHILD = r'''
import json, sys, time
from arbor.rollout.sandbox import SandboxConfig, run_python
system, runs = sys.argv[1], int(sys.argv[2])
cfg = SandboxConfig(allow_weak_isolation=True) if system == "before" else SandboxConfig(isolation=system, allow_weak_isolation=True)
first = run_python("print(1)", cfg)
if first.stdout != "1\n":
    sys.exit(f"{system}: {first}")
times = []
for _ in range(runs):
    t = time.perf_counter()
    r = run_python("print(1)", cfg)
    times.append(time.perf_counter() - t)
    assert r.stdout == "1\n", r
print(json.dumps({"times": times, "mode": first.network}))
'''


def add_arguments(p) -> None:
    p.add_argument("--runs", type=int, default=20, help="calls per system per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", default=BASELINE, help="git revision of the `before` sandbox ('' to skip it)")


def _baseline_tree(rev: str, into: str) -> str | None:
    """The baseline's sandbox files extracted under ``into`` (a PYTHONPATH root), or None without git or that rev."""
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *_FILES], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if tar.returncode != 0:
        print(f"bench sandbox: no baseline ({tar.stderr.decode().strip()[:200]})")
        return None
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return into


def _round(system: str, path: str, runs: int) -> dict | None:
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", _CHILD, system, str(runs)], capture_output=True, text=True,
                       env=env, cwd=path, timeout=600)
    if r.returncode != 0:
        print(f"bench sandbox: {system} does not run here: {(r.stderr or r.stdout).strip()[-300:]}")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _p90(xs) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main(args) -> None:
    from arbor.rollout.sandbox import network_isolation
    default = network_isolation("auto")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {s: str(ROOT) for s in SYSTEMS}
        paths["before"] = args.baseline and _baseline_tree(args.baseline, tmp)
        if not paths["before"]:
            paths.pop("before")
        times, modes = {s: [] for s in paths}, {}
        for _ in range(args.rounds):
            for system, path in list(paths.items()):
                got = _round(system, path, args.runs)
                if got is None:
                    paths.pop(system)
                    times.pop(system)
                    continue
                times[system] += got["times"]
                modes[system] = got["mode"]
    before = median(times["before"]) if "before" in times else None
    rows = [[s, modes[s], median(ts) * 1e3, _p90(ts) * 1e3, median(ts) / before if before else "-"]
            for s, ts in times.items()]
    print_table(f"sandbox start-up, run_python('print(1)'), {args.rounds} rounds x {args.runs} runs",
                ["system", "isolation", "median ms", "p90 ms", "/ before"], rows)
    ratio = median(times[default]) / before if before and default in times else None
    targets = [target(f"default isolation ({default}) start-up / before's, median", ratio, "<= 1.5",
                      ratio is not None and ratio <= 1.5)]
    print_targets(targets)
    result = {"config": vars(args) | {"default_isolation": default},
              "systems": {s: {"isolation": modes[s], "median_s": median(ts), "p90_s": _p90(ts),
                              "over_before": median(ts) / before if before else None, "times_s": ts}
                          for s, ts in times.items()},
              "targets": targets}

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(times)
        ax.boxplot([[t * 1e3 for t in times[n]] for n in names], showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), names)
        ax.set_ylabel("ms per run_python('print(1)')")
        ax.set_title("sandbox start-up")
        return fig
    write_result(args.out, "sandbox", result, plot)
