"""Time to held-out accuracy, Arbor against TRL's ``GRPOTrainer``, on a user's own task (``arbor bench e2e``).

The task is ``examples/math-word-problems``: its data (``make_data.py``, seed 0: 4000 train rows, 200
held-out), its ``math`` reward (math-verify against the number after ``####``), and its tiny
character-level model after an SFT stage with the example's settings (``arbor sft``; built once per
variant and cached in OUT/e2e/sft-<variant>). From that model, each system trains for the variant's
horizon of wall clock (below), ``--seeds`` times, in a child process of its own with the same torch
threads, one run at a time:

- Arbor: the trainer and loop of ``arbor train`` (``arbor.bench.e2e_worker``), Arbor's defaults but for
  the keys the example sets (temperature 0.7, lr 3e-4 with 5 warm-up steps, AdamW betas 0.9/0.999)
  and C3PO++ off (it fills a token budget, so its samples per step vary; off, a step is exactly
  ``groups_per_step`` × group size samples, the number TRL's step takes);
- TRL (installed beside Arbor when missing: ``arbor.bench.rl_trl.ensure_trl``): ``GRPOTrainer``
  (``python -m arbor.bench.rl_trl e2e``) with the same samples per step, group size, max new tokens,
  temperature, learning rate and schedule, AdamW betas, gradient clip, no KL (``trl_config``);
  TRL's own defaults otherwise (its ``dapo`` loss, ε = 0.2). Both losses average over the batch's
  trained tokens (TRL's ``dapo``, Arbor's default ``loss.agg=token``) with one optimizer step per batch.

Two variants: ``tool`` (the example's calculator, ``tools.py:calc``: Arbor's ``tools=[…]``, TRL's ``tools=``
argument), from the model SFT'd on ``sft.jsonl`` (run.sh's stage 1: calculator calls, and answers "in its
head" it cannot compute, which RL learns to replace by calls); and ``plain`` (no tools), from the model
SFT'd on ``sft_worked.jsonl`` (each step's arithmetic written out, ``8*7=56``, then ``Answer: N``), whose
slips RL reduces. Each variant trains for its own horizon (``SECONDS``: plain 120 s, tool 300 s, where TRL's
tool runs are still rising at 120 s; ``--seconds`` sets both). Both children save the model on their
training clock (``TrainClock``: from the child's start, imports and set-up included, saves excluded)
at gaps of ``--save-growth`` (5 %) of the clock, at least ``--save-every`` seconds: a time to the
threshold is resolved to the same fraction of itself for both systems. After each run Arbor's
engine evaluates every saved model (then deleted), and the SFT model at t = 0, on the first
``--eval-rows`` held-out rows, greedily (the evaluator of ``arbor eval``, identical for both).

Reported per variant: each system's final accuracy at the horizon (median over seeds and the spread), and
the time each run first reaches 90 % of the better system's median final accuracy (``time_to``); the ratio
is the median of Arbor's times over the median of TRL's. TRL's runs train on past the horizon, to
``--trl-overtime`` (2) times it, saved at the horizon too (its finals are read there, as Arbor's): a TRL
run that reaches the threshold only after the horizon is timed, not censored. A TRL median that never
reaches it within that longer run makes the ratio an upper bound (that run's length used for TRL's time),
reported as such. There is no ratio when that threshold is within evaluation noise of the SFT model's
accuracy (``learned``: the gap must exceed two binomial standard errors on ``--eval-rows`` rows). Also reported: each system's
clock at the end of its first step (start-up included), seconds per step, steps to the threshold.
Targets (issue 42): plain ≤ 0.5× TRL's time, tool ≤ 0.33×; Arbor's final accuracy no lower than
TRL's within the seeds' spread (≥ TRL's lowest seed).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from arbor.bench.common import print_table, print_targets, target, write_result

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math-word-problems"
VARIANTS = ("plain", "tool")
WANTED = {"plain": 0.5, "tool": 0.33}
SECONDS = {"plain": 120.0, "tool": 300.0}      # each variant's horizon (``--seconds`` overrides both)
SFT_ARGS = ("train.steps=1500", "train.batch_tokens=4096", "train.log_every=250", "train.optim.lr=3e-3",
            "train.optim.min_lr_ratio=1.0", "train.checkpoint_every=0")     # examples/math-word-problems/run.sh
CALC = f"{EXAMPLE / 'tools.py'}:calc"          # the example's calculator, as ``tools=[…]`` names it
SFT_DATA = {"plain": ("sft_worked.jsonl", []), "tool": ("sft.jsonl", [CALC])}


@dataclass
class Settings:
    """What both systems are matched in (one place: ``arbor_overrides`` and ``trl_config`` read it)."""
    groups_per_step: int = 8          # prompts per step (Arbor's default)
    group_size: int = 4               # samples per prompt (Arbor's default rollout.branch=[4])
    max_new_tokens: int = 64          # per model turn (Arbor's rollout.max_turn_tokens default)
    max_turns: int = 6                # model turns of a tool episode (Arbor's default)
    temperature: float = 0.7          # the example's
    lr: float = 3e-4                  # the example's
    warmup_steps: int = 5             # the example's; constant after
    betas: tuple[float, float] = (0.9, 0.999)   # the example's
    grad_clip: float = 1.0            # both defaults

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size


def arbor_overrides(s: Settings, variant: str, data: Path, model: Path, out: Path, seed: int, eval_rows: int) -> list[str]:
    """``arbor train`` keys of one run (as the example's run.sh writes them)."""
    tools = json.dumps([CALC] if variant == "tool" else [])
    return [f"model={model}", f"out={out}", f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'test.jsonl'}",
            "data.prompt_key=question", 'reward.fns=["math"]', f"tools={tools}", f"seed={seed}",
            f"rollout.seed={seed}", "steps=100000", f"groups_per_step={s.groups_per_step}",
            f"rollout.branch=[{s.group_size}]", f"rollout.temperature={s.temperature}",
            f"rollout.max_turn_tokens={s.max_new_tokens}", f"rollout.max_turns={s.max_turns}", f"optim.lr={s.lr}",
            f"optim.warmup_steps={s.warmup_steps}", f"optim.betas={list(s.betas)}", "optim.min_lr_ratio=1.0",
            f"optim.grad_clip={s.grad_clip}", "c3po.enabled=false", "checkpoint_every=0", "eval_every=0",
            f"eval_problems={eval_rows}"]


def trl_config(s: Settings, variant: str) -> dict:
    """GRPOConfig keys of one TRL run. TRL bounds a whole completion (model turns and tool results
    together), Arbor each model turn: with tools TRL gets ``max_turns`` × ``max_new_tokens`` in all."""
    tool = variant == "tool"
    cfg = {"per_device_train_batch_size": s.samples_per_step, "num_generations": s.group_size,
           "gradient_accumulation_steps": 1, "num_iterations": 1,
           "max_completion_length": s.max_new_tokens * (s.max_turns if tool else 1),
           "temperature": s.temperature, "top_p": 1.0, "top_k": 0, "learning_rate": s.lr,
           "lr_scheduler_type": "constant_with_warmup", "warmup_steps": s.warmup_steps, "adam_beta1": s.betas[0],
           "adam_beta2": s.betas[1], "weight_decay": 0.0, "max_grad_norm": s.grad_clip, "beta": 0.0,
           "max_steps": 10 ** 6, "bf16": False, "fp16": False, "gradient_checkpointing": False, "use_vllm": False}
    if tool:
        cfg["max_tool_calling_iterations"] = s.max_turns - 1
    return cfg


def time_to(curve: list[tuple[float, float]], threshold: float) -> float | None:
    """First time of ``curve`` [(seconds, accuracy)] whose accuracy is ≥ ``threshold`` (None: never)."""
    return next((t for t, acc in sorted(curve) if acc >= threshold), None)


def final_at(curve: list[tuple[float, float]], horizon: float) -> float:
    """The accuracy of ``curve``'s first model saved at or after ``horizon`` (a run that stops there saves
    its last model then; one that goes on is saved then too: ``TrainClock``'s ``mark``), else its last."""
    ordered = sorted(curve)
    return next((acc for t, acc in ordered if t >= horizon), ordered[-1][1])


def median_time(times: list[float | None], limit: float) -> tuple[float, bool]:
    """(median of ``times``, never-reached counted as ``limit``; whether that median depends on ``limit``:
    at least half never reached it)."""
    m = statistics.median([limit if t is None else t for t in times])
    return m, sum(t is None for t in times) * 2 >= len(times)


def steps_at(run: dict, t: float | None) -> int | None:
    """Optimizer steps done by the model ``run`` saved at clock ``t`` (0 at t = 0: the SFT model; None: never)."""
    if t is None or t == 0:
        return None if t is None else 0
    return next(x["step"] for x in run["snapshots"] if x["train_s"] == t)


def where_time_went(rs: list[dict], times: list[float | None]) -> dict:
    """Medians over runs of: the clock at the end of the first step (start-up included), one step's
    seconds (the median gap between step ends), and the steps done at the time to the threshold."""
    return {"first_step_end_s": statistics.median(r["step_end_s"][0] for r in rs),
            "step_s": statistics.median(statistics.median(b - a for a, b in zip(r["step_end_s"], r["step_end_s"][1:]))
                                        for r in rs),
            "steps_to_threshold": [steps_at(r, t) for r, t in zip(rs, times)]}


def learned(base: float, threshold: float, rows: int) -> bool:
    """Whether reaching ``threshold`` from the t = 0 accuracy ``base`` shows learning: the gap must exceed
    two binomial standard errors of an accuracy of ``threshold`` measured on ``rows`` rows,
    2·√(p(1−p)/rows); a smaller one is crossed by evaluation noise alone."""
    return threshold - base > 2 * math.sqrt(threshold * (1 - threshold) / rows)


def summarize(runs: dict[str, list[dict]], seconds: float, wanted: float, name: str,
              rows: int = 100, limits: dict[str, float] | None = None) -> tuple[dict, list[dict]]:
    """Per-system finals at the horizon ``seconds`` and times to 90 % of the better median final, each
    system's times looked for up to its ``limits`` (default: the horizon; a system that trained on past
    it may reach the threshold later); → (summary, targets). No ratio when that threshold is not
    ``learned`` from the runs' t = 0 accuracy (on ``rows`` held-out rows)."""
    limits = {k: seconds for k in runs} | (limits or {})
    finals = {k: [final_at(r["curve"], seconds) for r in rs] for k, rs in runs.items()}
    best = max(statistics.median(v) for v in finals.values())
    threshold = 0.9 * best
    base = min(r["curve"][0][1] for rs in runs.values() for r in rs)
    out = {"threshold": threshold, "better_final": best, "horizon_s": seconds}
    for k, rs in runs.items():
        times = [time_to(r["curve"], threshold) for r in rs]
        m, censored = median_time(times, limits[k])
        out[k] = {"final": finals[k], "final_median": statistics.median(finals[k]), "time_to_threshold_s": times,
                  "median_time_s": m, "median_censored": censored, "limit_s": limits[k]}
        if all(len(r.get("step_end_s", ())) > 1 for r in rs):
            out[k].update(where_time_went(rs, times))
    a, t = out["arbor"], out["trl"]
    noise = not learned(base, threshold, rows)
    ratio = None if a["median_censored"] or t["median_time_s"] == 0 or noise else a["median_time_s"] / t["median_time_s"]
    out["ratio"], out["ratio_is_upper_bound"] = ratio, t["median_censored"]
    if t["median_time_s"] == 0:
        out["note"] = "the SFT model (t = 0) already reaches the threshold: no time to compare"
    elif noise:
        out["note"] = (f"the threshold {threshold:.3g} is within evaluation noise of the SFT model's accuracy {base:.3g} "
                       f"on {rows} rows (learned()): neither system learned, no time to compare")
    targets = [target(f"{name}: Arbor ÷ TRL time to 90 % of the better final accuracy (median of seeds)",
                      ratio, f"<= {wanted}", ratio is not None and ratio <= wanted),
               target(f"{name}: Arbor's median final accuracy ≥ TRL's lowest seed", a["final_median"],
                      f">= {min(t['final'])}", a["final_median"] >= min(t["final"]))]
    return out, targets


def child(cmd: list[str], threads: int, timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def prepare(work: Path, threads: int, variants=VARIANTS) -> tuple[Path, dict[str, Path]]:
    """The example's data and each variant's SFT model in ``work/sft-<variant>`` (built once: reused when its
    ``model.safetensors`` is there): ``tool`` from ``sft.jsonl`` with the calculator (run.sh's stage 1),
    ``plain`` from ``sft_worked.jsonl``, the same questions worked out in writing without a tool."""
    data = work / "data"
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), str(data), "--seed", "0", "--mental-rate", "0.7"],
                   check=True, capture_output=True)
    sfts = {}
    for v in variants:
        sft = sfts[v] = work / f"sft-{v}"
        if not (sft / "model.safetensors").is_file():
            rows, tools = SFT_DATA[v]
            print(f"SFT of the example's tiny model on {rows} (run.sh's settings) into {sft} …", flush=True)
            subprocess.run([sys.executable, "-m", "arbor", "sft", "model=tiny", f"data.train={data / rows}",
                            f"tools={json.dumps(tools)}", f"out={sft}", "train.seed=0", *SFT_ARGS],
                           check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return data, sfts


class Evaluator:
    """Arbor's engine on held-out rows (``arbor eval``'s trainer), loading each saved model in turn."""

    def __init__(self, variant: str, data: Path, sft: Path, rows: int, s: Settings, work: Path):
        from arbor import configs
        from arbor.train.config import RLConfig
        from arbor.train.run import build_trainer
        cfg = configs.load(RLConfig, None, arbor_overrides(s, variant, data, sft, work / "eval_out", 0, rows))
        self.trainer, self.rows = build_trainer(cfg), rows

    def accuracy(self, folder) -> float:
        from arbor.models import load_model
        from arbor.train.lora import sync_tensors
        self.trainer.model.load_state_dict(load_model(folder).state_dict())
        self.trainer.engine.update_weights(sync_tensors(self.trainer.model))
        metrics, _ = asyncio.run(self.trainer.evaluate_rows(self.rows))
        return metrics["test_accuracy"]


def run(out_dir="benchmarks/results", seconds: float | None = None, save_every=0.25, seeds=(0, 1, 2), threads=2,
        eval_rows=200, variants=VARIANTS, trl="auto", settings: Settings | None = None, save_growth=0.05,
        trl_overtime=2.0) -> dict:
    """``seconds``: every variant's horizon (None: ``SECONDS``); TRL's runs train ``trl_overtime`` × as long."""
    import torch
    torch.set_num_threads(threads)
    s = settings or Settings()
    out = Path(out_dir)
    work = out / "e2e"
    from arbor.bench.rl_trl import ensure_trl
    trl_version = ensure_trl() if trl != "off" else None
    data, sfts = prepare(work, threads, variants)
    horizon = {v: seconds or SECONDS[v] for v in variants}
    result = {"config": {"settings": asdict(s), "seconds": horizon, "save_every_s": save_every,
                         "save_growth": save_growth, "trl_overtime": trl_overtime, "seeds": list(seeds),
                         "threads": threads, "eval_rows": eval_rows, "trl_version": trl_version,
                         "sft_model": {v: str(p) for v, p in sfts.items()}, "sft": list(SFT_ARGS),
                         "sft_data": {v: SFT_DATA[v][0] for v in variants},
                         "arbor_train": {v: arbor_overrides(s, v, data, sfts[v], work, 0, eval_rows)
                                                                 for v in variants},
                         "trl_grpo_config": {v: trl_config(s, v) for v in variants},
                         "differences": DIFFERENCES}, "variants": {}}
    targets, rows = [], []
    for v in variants:
        sft, seconds = sfts[v], horizon[v]
        ev = Evaluator(v, data, sft, eval_rows, s, work)
        base = ev.accuracy(sft)
        runs = {"arbor": [], "trl": []} if trl_version else {"arbor": []}
        for seed in seeds:          # Arbor and TRL alternate, so drifting machine load hits both alike
            for system in runs:
                d = work / "runs" / f"{v}-{system}-{seed}"
                cmd = arbor_cmd(s, v, data, sft, d, seed, eval_rows) if system == "arbor" else \
                    trl_cmd(s, v, data, sft, d, seed, work)
                limit = seconds * (trl_overtime if system == "trl" else 1.0)
                r = child(cmd + ["--out", str(d), "--seconds", str(limit), "--save-at", str(seconds),
                                 "--save-every", str(save_every), "--save-growth", str(save_growth),
                                 "--threads", str(threads)], threads, timeout=limit * 4 + 600)
                r["curve"] = [(0.0, base)] + [(x["train_s"], ev.accuracy(x["path"])) for x in r["snapshots"]]
                shutil.rmtree(d)            # the saved models (~3 MB each, ~40 a run) once evaluated
                runs[system].append(r)
                print(f"{v} {system} seed {seed}: {r['steps']} steps, accuracy "
                      + " ".join(f"{acc:.2f}@{t:.0f}s" for t, acc in r["curve"]), flush=True)
        entry = {"sft_accuracy": base, "runs": runs}
        if "trl" in runs:
            summary, tg = summarize(runs, seconds, WANTED[v], v, eval_rows, {"trl": seconds * trl_overtime})
            entry["summary"] = summary
            targets += tg
            for k in runs:
                time_cell = (f"> {summary[k]['limit_s']:g} (median never)" if summary[k]["median_censored"]
                             else summary[k]["median_time_s"])
                rows.append([f"{v}: {k}", summary[k]["final_median"], f"{min(summary[k]['final']):.2f}–"
                             f"{max(summary[k]['final']):.2f}", time_cell, ratio_cell(summary) if k == "arbor" else "",
                             summary[k].get("first_step_end_s", "–"), summary[k].get("step_s", "–"),
                             " ".join(str(n) for n in summary[k].get("steps_to_threshold", ()))])
        result["variants"][v] = entry
    print_table(f"time to 90 % of the better final held-out accuracy, {threads} threads, runs of {horizon} s, "
                f"seeds {list(seeds)}", ["run", "final acc (median)", "spread", "time to 90 % (s)", "÷ TRL", "1st step ends (s)", "s / step",
                 "steps to 90 %"], rows)
    result["targets"] = targets
    print_targets(targets)
    write_result(out, "e2e", result, lambda plt: plot(plt, result))
    return result


def ratio_cell(summary: dict) -> str:
    r = summary["ratio"]
    return "–" if r is None else ("≤ " if summary["ratio_is_upper_bound"] else "") + f"{r:.3g}"


DIFFERENCES = [
    "C3PO++ is off in Arbor (its default is on): with it a step fills a token budget, so samples per step could not match",
    "TRL's max_completion_length bounds a whole tool episode (model turns and tool results): max_turns × max_new_tokens; "
    "Arbor bounds each model turn at max_new_tokens and an episode at max_turns turns (rollout.max_context 640)",
    "losses are each system's default: Arbor's PPO clip 0.2/0.28 with dual clip and IcePop, TRL's dapo with ε = 0.2; "
    "both average over the step's trained tokens (Arbor's loss.agg=token) and take one optimizer step per batch, "
    "so the ratio is 1 and neither clip acts",
    "Arbor samples with its own engine; TRL with transformers' generate (no vLLM on this CPU)",
]


def arbor_cmd(s, v, data, sft, d, seed, eval_rows) -> list[str]:
    keys = arbor_overrides(s, v, data, sft, d / "arbor_out", seed, eval_rows)
    return [sys.executable, "-m", "arbor.bench.e2e_worker", *keys]


def trl_cmd(s, v, data, sft, d, seed, work) -> list[str]:
    cfg = work / f"trl_config_{v}.json"
    cfg.write_text(json.dumps(trl_config(s, v)))
    tools = ["--tools", CALC] if v == "tool" else []
    return [sys.executable, "-m", "arbor.bench.rl_trl", "e2e", "--model", str(sft), "--train", str(data / "train.jsonl"),
            "--config", str(cfg), "--seed", str(seed), *tools]


def plot(plt, result: dict):
    names = list(result["variants"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 3.8), squeeze=False)
    for ax, v in zip(axes[0], names):
        e = result["variants"][v]
        for i, (system, runs) in enumerate(e["runs"].items()):
            grid = sorted({t for r in runs for t, _ in r["curve"]})
            # each run's accuracy at g: that of its latest model saved by then (a step function of time)
            cols = list(zip(*[[[acc for t, acc in sorted(r["curve"]) if t <= g][-1] for g in grid] for r in runs]))
            label = "Arbor" if system == "arbor" else f"TRL {result['config']['trl_version']}"
            ax.step(grid, [statistics.median(c) for c in cols], where="post", color=f"C{i}", label=f"{label} (median of seeds)")
            ax.fill_between(grid, [min(c) for c in cols], [max(c) for c in cols], step="post", color=f"C{i}", alpha=0.2)
        if "summary" in e:
            ax.axhline(e["summary"]["threshold"], color="grey", ls=":", lw=1, label="90 % of the better final")
            if e["summary"]["trl"]["limit_s"] > e["summary"]["horizon_s"]:
                ax.axvline(e["summary"]["horizon_s"], color="black", ls=":", lw=1, label="horizon (finals read here)")
            for i, system in enumerate(e["runs"]):      # a time is marked where it is compared (no note)
                if not e["summary"][system]["median_censored"] and "note" not in e["summary"]:
                    ax.axvline(e["summary"][system]["median_time_s"], color=f"C{i}", ls="--", lw=1)
        ax.set_title(f"{v}: held-out accuracy ({result['config']['eval_rows']} rows, greedy)")
        ax.set_xlabel("training wall-clock (s)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    return fig


def add_arguments(p) -> None:
    p.add_argument("--seconds", type=float, default=None,
                   help=f"training wall-clock per run, every variant (default: each its own, {SECONDS})")
    p.add_argument("--save-every", type=float, default=0.25,
                   help="fewest seconds of training clock between saved models")
    p.add_argument("--save-growth", type=float, default=0.05,
                   help="a save at clock t is followed by one at t * (1 + this) or later (times resolved to 5 %%)")
    p.add_argument("--seeds", type=int, default=3, help="runs per system and variant (seeds 0…n-1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every run and of the evaluation")
    p.add_argument("--eval-rows", type=int, default=200,
                   help="held-out rows each saved model is evaluated on (200: all)")
    p.add_argument("--variant", default="both", choices=["plain", "tool", "both"])
    p.add_argument("--trl-overtime", type=float, default=2.0,
                   help="TRL's runs train this many times the horizon, so a time to the threshold past it is seen")
    p.add_argument("--trl", default="auto", choices=["auto", "off"], help="off: Arbor's curves only (no TRL, no ratio)")


def main(args) -> None:
    for flag, v in (("--seconds", 1 if args.seconds is None else args.seconds), ("--save-every", args.save_every),
                    ("--seeds", args.seeds), ("--threads", args.threads), ("--eval-rows", args.eval_rows)):
        if v <= 0:
            raise SystemExit(f"{flag} must be > 0, got {v}")
    if args.save_growth < 0:
        raise SystemExit(f"--save-growth must be ≥ 0, got {args.save_growth}")
    if args.trl_overtime < 1:
        raise SystemExit(f"--trl-overtime must be ≥ 1 (TRL trains at least the horizon), got {args.trl_overtime}")
    run(out_dir=args.out, seconds=args.seconds, save_every=args.save_every, seeds=tuple(range(args.seeds)),
        threads=args.threads, eval_rows=args.eval_rows, variants=VARIANTS if args.variant == "both" else (args.variant,),
        trl=args.trl, save_growth=args.save_growth, trl_overtime=args.trl_overtime)
