"""Arbor's RL step against TRL's ``GRPOTrainer``, on TRL's shape and on an agentic one (``arbor bench rl``).

Both systems train the same HF folder (``--model``; default: a tiny random Qwen3, hidden 256,
written to OUT/rl_model) in float32 with one optimizer step per batch, beta = 0, sampling at
temperature 1, EOS ignored. Workloads (``arbor.bench.rl_workloads``):

- ``trl``: 8 prompts × 4 samples × 32 new tokens; prompts are a one-line instruction in the chat
  template (the same token ids for TRL).
- ``agentic``: a 512-token shared system prompt + task, 3 model turns of 64 tokens, a tool answer
  of 64–256 tokens after the first two, branching [4, 2] (8 trajectories per group). TRL has no
  environment turns, so its closest equivalent is documented as: each group's prompt (system +
  task) with 8 completions of the flattened rest of a trajectory (3 × 64 model tokens + the mean
  tool-turn length), all generated and trained; its trained tokens/s counts the 3 × 64 model
  tokens per sample, the tokens Arbor trains, so the ratio is the ratio of trajectories per second.

Arbor runs ``arbor.train.rl.RLTrainer`` (the trainer of ``arbor train``) synchronously (C3PO++
off); each step is timed whole and per phase (rollout, log-prob recompute, train, weight sync);
medians over ``--steps`` steps after one warm-up step. Trained tokens = the loss (model) tokens
of every trajectory. TRL (when importable) runs in a subprocess (``arbor.bench.rl_trl``) on the
same threads. Targets: trained tokens/s ≥ 1.5× TRL on TRL's shape, ≥ 3× on the agentic one.

``--overlap on|both`` also (or only) times Arbor with ``rollout.overlap=true``: the next step's
rollout on a thread of its own while this step trains, the torch threads split between the two
(``rollout.overlap_threads``); its rollout phase is then the time the trainer waited for the
rollout, and ``rollout_ahead_s`` the rollout's own time. ``--threads N`` below the CPUs this
process may use also pins the whole bench (Arbor's threads and the TRL subprocess) to N CPUs, so
that a thread budget is a core budget for every system, overlapped or not.
``--engine-share-weights false`` (``engine.share_weights=false``) gives a float32 engine its own copy of
the weights (oneDNN-packed on CPU), copied and repacked at every sync, instead of the trainer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from arbor.bench.common import median, print_table, print_targets, target, write_result
from arbor.bench.rl_workloads import Workload, default_model, make_task, prompt_texts, workload

PHASES = ["rollout_s", "recompute_s", "train_s", "sync_s"]
WANTED = {"trl": 1.5, "agentic": 3.0}
VARIANTS = {"off": (False,), "on": (True,), "both": (False, True)}    # --overlap → Arbor runs without / with
KEY = {False: "arbor", True: "arbor_overlap"}


def pin_cpus(cpus) -> None:
    """Set the CPUs of every thread of this process (threads and processes started later inherit them)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:      # a thread that ended meanwhile
            pass


@contextlib.contextmanager
def cpu_budget(n: int):
    """Within: the process runs on its first ``n`` allowed CPUs when it may use more (→ the CPUs); after:
    on all of them again."""
    allowed = sorted(os.sched_getaffinity(0))
    mine = allowed[:n] if n and n < len(allowed) else allowed
    pin_cpus(mine)
    try:
        yield mine
    finally:
        pin_cpus(allowed)


def arbor_trainer(model_dir, w: Workload, steps: int, engine_dtype: str, device: str, seed: int = 0,
                  overlap: bool = False, share_weights: bool = True, **overrides):
    """The RL trainer of ``arbor train`` on ``model_dir`` and workload ``w`` (``overrides``: RLConfig fields)."""
    from arbor.engine.config import EngineConfig
    from arbor.models import load_model
    from arbor.models.tokenizer import Tokenizer
    from arbor.train.config import C3POConfig, RLConfig, RLRolloutConfig, engine_config
    from arbor.train.rl import RLTrainer
    from arbor.train.run import make_engine
    torch.manual_seed(seed)
    model = load_model(model_dir, dtype=torch.float32, device=device)
    tok = Tokenizer.load(model_dir)
    cfg = RLConfig(model=str(model_dir), task=f"bench-{w.name}", seed=seed, device=device, steps=steps + 1,
                   groups_per_step=w.prompts, checkpoint_every=0,
                   engine=EngineConfig(dtype=engine_dtype, share_weights=share_weights),
                   c3po=C3POConfig(enabled=False),
                   rollout=RLRolloutConfig(max_turn_tokens=w.new_tokens, max_context=w.max_context, branch=list(w.branch),
                                           end_on_truncation=False, overlap=overlap), **overrides)
    cfg.validate()
    engine, sampling = make_engine(model, tok, engine_config(cfg))
    return RLTrainer(cfg, model, tok, engine, sampling, make_task(w, tok))


def run_arbor(model_dir, w: Workload, steps: int, engine_dtype: str, device: str, overlap: bool = False,
              **overrides) -> dict:
    """→ medians of step seconds, phases and trained tokens over ``steps`` steps after a warm-up step."""
    trainer = arbor_trainer(model_dir, w, steps, engine_dtype, device, overlap=overlap, **overrides)
    hist, walls = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        row = asyncio.run(trainer.train_step())
        walls.append(time.perf_counter() - t0)
        hist.append(row)
    hist, walls = hist[1:], walls[1:]
    step_s, tokens = median(walls), median([r["tokens"] for r in hist])
    keep = [k for k in hist[0] if isinstance(hist[0][k], (int, float))]
    phases = PHASES + (["rollout_ahead_s"] if overlap else [])
    return {"step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s, "overlap": overlap,
            "phases_s": {k: median([r[k] for r in hist]) for k in phases},
            "samples_per_step": median([r["samples"] for r in hist]),
            "recompute_skipped": bool(hist[0].get("recompute_skipped", False)),
            "history": [{k: r[k] for k in keep} for r in hist]}


def trl_completion(w: Workload, tok) -> int:
    """Tokens TRL generates per sample for ``w``: the flattened rest of a trajectory (model turns +
    mean tool turns with their chat framing)."""
    from arbor.rollout.chat import ChatLayout
    framing = ChatLayout(tok).env_turn_ids([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
                                           [{"role": "tool", "content": ""}])
    tool = (w.tool_min + w.tool_max) // 2 + len(framing)
    return w.turns * w.new_tokens + (w.turns - 1) * tool


def run_trl(model_dir, w: Workload, steps: int, threads: int, device: str, timeout: float) -> dict:
    """TRL's GRPOTrainer on ``w`` in a subprocess; → its timings and trained tokens/s (model tokens)."""
    from arbor.models.tokenizer import Tokenizer
    tok = Tokenizer.load(model_dir)
    completion = trl_completion(w, tok)
    with tempfile.TemporaryDirectory(prefix="arbor-bench-rl-") as tmp:      # the child's prompts: not a result
        prompts = Path(tmp) / f"prompts_{w.name}.json"
        prompts.write_text(json.dumps(prompt_texts(w, tok, w.prompts * (steps + 1))))
        cmd = [sys.executable, "-m", "arbor.bench.rl_trl", "--model", str(model_dir), "--prompts", str(prompts),
               "--batch-prompts", str(w.prompts), "--generations", str(w.samples), "--completion", str(completion),
               "--steps", str(steps), "--threads", str(threads), "--device", device]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads), "TRL_EXPERIMENTAL_SILENCE": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"TRL run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    r["history_s"] = r.pop("step_s")
    step_s = median(r["history_s"])
    trained = w.prompts * w.samples * w.model_tokens
    return {**r, "step_s": step_s, "completion_tokens": completion, "tokens_per_step": trained,
            "tokens_per_s": trained / step_s, "completion_tokens_per_s": r["completion_tokens_per_step"] / step_s}


def merge_rounds(runs: list[dict]) -> dict:
    """Several rounds of one system → medians over rounds (step seconds, tokens/s, phases), the rounds kept."""
    if len(runs) == 1:
        return runs[0]
    out = {k: median([r[k] for r in runs]) for k in ("step_s", "tokens_per_s", "tokens_per_step")}
    if "phases_s" in runs[0]:
        out["phases_s"] = {k: median([r["phases_s"][k] for r in runs]) for k in runs[0]["phases_s"]}
    return {**runs[0], **out, "rounds": runs}


def run(out_dir="bench_results", model=None, workloads=("trl", "agentic"), steps=3, threads=0, engine_dtype="float32",
        device="cpu", trl="auto", prompts=None, trl_timeout=1200.0, rounds=1, overlap="off", share_weights=True,
        **overrides) -> dict:
    if threads:
        torch.set_num_threads(threads)
    with cpu_budget(threads) as cpus:
        return _run(Path(out_dir), model, workloads, steps, engine_dtype, device, trl, prompts, trl_timeout, rounds,
                    overlap, len(cpus), share_weights=share_weights, **overrides)


def _run(out: Path, model, workloads, steps, engine_dtype, device, trl, prompts, trl_timeout, rounds, overlap, cpus,
         **overrides) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    model_dir = Path(model) if model else default_model(out / "rl_model")
    has_trl = trl != "off" and importlib.util.find_spec("trl") is not None
    if trl == "on" and not has_trl:
        raise SystemExit("--trl on: the trl package is not importable (pip install trl)")
    result = {"config": {"model": str(model_dir), "steps": steps, "rounds": rounds, "threads": threads,
                         "engine_dtype": engine_dtype, "device": device, "trl": has_trl, "overlap": overlap,
                         "cpus": cpus, "engine_share_weights": overrides.get("share_weights", True)},
              "workloads": {}}
    rows, targets = [], []
    for name in workloads:
        w = workload(name, prompts)
        arbor_runs, trl_runs = {v: [] for v in VARIANTS[overlap]}, []
        for _ in range(rounds):      # Arbor and TRL alternate, so drifting machine load hits both alike
            for v in arbor_runs:
                arbor_runs[v].append(run_arbor(model_dir, w, steps, engine_dtype, device, overlap=v, **overrides))
            if has_trl:
                trl_runs.append(run_trl(model_dir, w, steps, threads, device, trl_timeout))
        entry = {"shape": w.__dict__ | {"samples": w.samples}}
        t = merge_rounds(trl_runs) if has_trl else None
        if t is not None:
            entry["trl"] = t
            result["config"]["trl_version"] = t["trl"]
        for v, runs in arbor_runs.items():
            a = entry[KEY[v]] = merge_rounds(runs)
            label = f"{name}: Arbor" + (" overlap" if v else "")
            ph = a["phases_s"]
            rows.append([label, a["step_s"]] + [1e3 * ph[k] for k in PHASES] + [a["tokens_per_s"], ""])
            ratio = None
            if t is not None:
                ratio = median([x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs, trl_runs)])
                entry["ratio_overlap" if v else "ratio"] = ratio
                rows[-1][-1] = ratio
            what = (f"{name}: Arbor{' (rollout.overlap=true)' if v else ''} ÷ TRL trained tokens/s, {threads} threads"
                    + ("" if has_trl else " (trl not installed: not measured)"))
            targets.append(target(what, ratio, f">= {WANTED[name]}", ratio is not None and ratio >= WANTED[name]))
        if t is not None:
            rows.append([f"{name}: TRL {t['trl']}", t["step_s"], "", "", "", "", t["tokens_per_s"], ""])
        if len(arbor_runs) == 2:     # overlap's own gain, paired by round
            entry["overlap_speedup"] = median([y["tokens_per_s"] / x["tokens_per_s"]
                                               for x, y in zip(arbor_runs[False], arbor_runs[True])])
        result["workloads"][name] = entry
    own = "" if overrides.get("share_weights", True) else " (own copy)"
    print_table(f"one RL step, {device}, {threads} threads, engine {engine_dtype}{own}, median of {steps} steps"
                + (f" × {rounds} rounds (ratio: median of the rounds' ratios)" if rounds > 1 else ""),
                ["system", "s/step", "rollout ms", "recompute ms", "train ms", "sync ms", "trained tok/s", "÷ TRL"], rows)
    result["targets"] = targets
    print_targets(targets)

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(result["workloads"])
        bars = [(f"{n}: Arbor" + (" overlap" if key == "arbor_overlap" else ""), result["workloads"][n][key]["phases_s"])
                for n in names for key in ("arbor", "arbor_overlap") if key in result["workloads"][n]]
        left = [0.0] * len(bars)
        for i, k in enumerate(PHASES):
            vals = [ph[k] for _, ph in bars]
            ax.barh([b for b, _ in bars], vals, left=left, label=k[:-2], color=f"C{i}")
            left = [x + y for x, y in zip(left, vals)]
        trl_names = [n for n in names if "trl" in result["workloads"][n]]
        if trl_names:
            ax.barh([f"{n}: TRL" for n in trl_names], [result["workloads"][n]["trl"]["step_s"] for n in trl_names],
                    color="grey", label="TRL step")
        ax.set_xlabel("seconds per RL step (median)")
        ax.legend(fontsize=7)
        return fig

    write_result(out, "rl", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--model", help="HF model folder (default: a tiny random Qwen3 written to OUT/rl_model)")
    p.add_argument("--workload", default="both", choices=["trl", "agentic", "both", "agent"],
                   help="agent: an OpenAI-client agent through the trainer's endpoint vs the same episodes built in "
                        "(arbor.bench.rl_agent; writes rl-agent.json)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system (after one warm-up step)")
    p.add_argument("--repeats", type=int, help="alias of --steps")
    p.add_argument("--rounds", type=int, default=1, help="Arbor/TRL runs alternated per workload (medians over rounds)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--engine-share-weights", default="true", choices=["true", "false"],
                   help="false: the engine keeps its own copy even in float32 (oneDNN-packed on CPU; engine.share_weights)")
    p.add_argument("--prompts", type=int, help="groups per step (default: 8 for trl, 2 for agentic)")
    p.add_argument("--trl", default="auto", choices=["auto", "on", "off"],
                   help="run TRL's GRPOTrainer for the ratio (auto: when trl is importable)")
    p.add_argument("--trl-timeout", type=float, default=1200.0, help="seconds before the TRL subprocess is killed")
    p.add_argument("--overlap", default="off", choices=sorted(VARIANTS),
                   help="Arbor with rollout.overlap=true: off, on (only), both (alternated, with the gain)")


def main(args) -> None:
    steps = args.repeats if args.repeats is not None else args.steps
    for flag, v in (("--steps/--repeats", steps), ("--rounds", args.rounds),
                    ("--prompts", args.prompts if args.prompts is not None else 1)):
        if v < 1:
            raise SystemExit(f"{flag} must be ≥ 1, got {v}")
    if args.threads < 0:
        raise SystemExit(f"--threads must be ≥ 0, got {args.threads}")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (an HF model folder is needed)")
    if args.workload == "agent":
        from arbor.bench.rl_agent import run as run_agent
        run_agent(out_dir=args.out, model=args.model, steps=steps, rounds=args.rounds, engine_dtype=args.engine_dtype,
                  device=args.device, prompts=args.prompts, threads=args.threads)
        return
    workloads = ("trl", "agentic") if args.workload == "both" else (args.workload,)
    run(out_dir=args.out, model=args.model, workloads=workloads, steps=steps, threads=args.threads,
        engine_dtype=args.engine_dtype, device=args.device, trl=args.trl, prompts=args.prompts,
        trl_timeout=args.trl_timeout, rounds=args.rounds, overlap=args.overlap,
        share_weights=args.engine_share_weights == "true")
