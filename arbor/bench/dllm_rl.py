"""RL for block-diffusion models: EBPO vs the mean-field (d1) baseline (``arbor bench dllm-rl``).

From the SFT base of ``arbor bench dllm`` (trained once into ``--cache``, shared with that bench),
each task × estimator × seed runs ``--steps`` RL steps of ``EBPOTrainer`` (the trainer of ``arbor
train`` on a block-diffusion model): ``--groups`` training prompts per step, ``--group-size``
diffusion-decoded rollouts each (``--rollout-mode``, temperature ``--temperature``), group
advantages, the EBPO block-ELBO ratio or the mean-field per-token ratio, asymmetric clip. Held-out
accuracy and TPF of greedy decoding on ``--eval-n`` fixed test problems, in LLaDA2.1 Quality and
Speed mode, before and after; Quality-mode accuracy every ``--eval-every`` steps for the curves.

Targets (spec): EBPO raises Countdown's held-out accuracy (Quality mode, mean over seeds) by ≥ 5
points at equal or higher TPF, and beats the mean-field baseline.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from arbor.bench.common import print_table, print_targets, target, write_result
from arbor.models import load_model
from arbor.dllm.ebpo_trainer import EBPOTrainer
from arbor.train.optim import OptimConfig
from arbor.train.config import EBPOConfig, RLConfig

EVAL_SEED = 777          # the held-out problems, the same for every run


def base_model_dir(cache: str, steps: int, device: str, log=print) -> Path:
    """The ``arbor bench dllm`` base (all tasks, block 64), trained into ``cache`` when missing."""
    from arbor.bench.dllm import BLOCK_SIZE, DATA_VERSION
    from arbor.dllm.sft import DiffusionModelConfig, DiffusionTrainConfig, train_from_config
    base = Path(cache) / f"v{DATA_VERSION}_base_b{BLOCK_SIZE}_s{steps}"
    if not (base / "config.json").exists():
        cfg = DiffusionTrainConfig(steps=steps, device=device, log_every=250,
                                   model=DiffusionModelConfig(block_size=BLOCK_SIZE))
        train_from_config(cfg, out_dir=base, on_log=log)
    return base


def evaluate(trainer: EBPOTrainer, problems) -> dict:
    out = {}
    for mode in ("quality", "speed"):
        scores, results, _ = trainer.decode(problems, mode)
        out[mode] = {"accuracy": 100.0 * sum(scores) / len(scores),
                     "tpf": sum(r.num_tokens for r in results) / max(1, sum(r.forwards for r in results))}
    return out


def run_one(base: Path, task: str, estimator: str, seed: int, args, out: Path) -> dict:
    torch.manual_seed(seed)
    model = load_model(base, device=args.device).eval()
    from arbor.models.tokenizer import Tokenizer
    cfg = RLConfig(model=str(base), out=str(out), task=task, seed=seed, steps=args.steps, groups_per_step=args.groups,
                   mini_batches=args.mini_batches, device=args.device, checkpoint_every=0, resume=False,
                   optim=OptimConfig(lr=args.lr, warmup_steps=0, min_lr_ratio=1.0),
                   dllm=EBPOConfig(estimator=estimator, group_size=args.group_size, mode=args.rollout_mode,
                                   temperature=args.temperature))
    cfg.log.progress = cfg.log.tensorboard = False
    trainer = EBPOTrainer(cfg, model, Tokenizer.load(base), task)
    problems = trainer.task.generate(args.eval_n, seed=EVAL_SEED, split="test")
    before = evaluate(trainer, problems)
    curve, rows, t0 = [(0, before["quality"]["accuracy"])], [], time.perf_counter()
    for step in range(args.steps):
        rows.append(trainer.train_step())
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            scores, _, _ = trainer.decode(problems, "quality")
            curve.append((step + 1, 100.0 * sum(scores) / len(scores)))
    after = evaluate(trainer, problems)
    curve.append((args.steps, after["quality"]["accuracy"]))
    return {"task": task, "estimator": estimator, "seed": seed, "before": before, "after": after, "curve": curve,
            "train_reward": [r["reward"] for r in rows], "seconds": time.perf_counter() - t0}


def summarise(runs: list[dict], tasks, estimators) -> tuple[list[list], dict]:
    table, summary = [], {}
    for task in tasks:
        for est in estimators:
            rs = [r for r in runs if r["task"] == task and r["estimator"] == est]
            m = lambda when, mode, key: statistics.mean(r[when][mode][key] for r in rs)
            s = {f"{when}_{mode}_{key}": m(when, mode, key) for when in ("before", "after")
                 for mode in ("quality", "speed") for key in ("accuracy", "tpf")}
            s["delta_quality"] = s["after_quality_accuracy"] - s["before_quality_accuracy"]
            s["delta_speed"] = s["after_speed_accuracy"] - s["before_speed_accuracy"]
            s["delta_quality_per_seed"] = [r["after"]["quality"]["accuracy"] - r["before"]["quality"]["accuracy"] for r in rs]
            summary[f"{task}/{est}"] = s
            table.append([task, est, len(rs), s["before_quality_accuracy"], s["after_quality_accuracy"], s["delta_quality"],
                          s["before_quality_tpf"], s["after_quality_tpf"], s["before_speed_accuracy"],
                          s["after_speed_accuracy"], s["before_speed_tpf"], s["after_speed_tpf"]])
    return table, summary


def targets_of(summary: dict) -> list[dict]:
    e, mf = summary.get("countdown/ebpo"), summary.get("countdown/mean_field")
    out = []
    if e:
        out.append(target("EBPO Countdown Δ held-out acc, Quality (points, mean of seeds)", e["delta_quality"], "≥ 5",
                          e["delta_quality"] >= 5))
        ratio = e["after_quality_tpf"] / e["before_quality_tpf"]
        out.append(target("EBPO Countdown TPF after ÷ before, Quality", ratio, "≥ 1 (equal or higher)", ratio >= 1.0))
    if e and mf:
        gap = e["delta_quality"] - mf["delta_quality"]
        out.append(target("EBPO − mean-field Countdown Δ acc, Quality (points)", gap, "> 0", gap > 0))
    return out


def plot(runs, tasks, estimators):
    def draw(plt):
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 3.6), squeeze=False)
        colours = {"ebpo": "tab:blue", "mean_field": "tab:orange"}
        for ax, task in zip(axes[0], tasks):
            for est in estimators:
                rs = [r for r in runs if r["task"] == task and r["estimator"] == est]
                for r in rs:
                    ax.plot(*zip(*r["curve"]), color=colours.get(est), alpha=0.3, lw=1)
                if rs:
                    steps = [s for s, _ in rs[0]["curve"]]
                    mean = [statistics.mean(r["curve"][i][1] for r in rs) for i in range(len(steps))]
                    ax.plot(steps, mean, "o-", color=colours.get(est), label=f"{est} (mean of {len(rs)})")
            ax.set_title(f"{task}: held-out accuracy, Quality mode")
            ax.set_xlabel("RL step")
            ax.set_ylabel("accuracy %")
            ax.legend()
        return fig
    return draw


def run(args) -> dict:
    """The bench; → its JSON result."""
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks, estimators = args.tasks.split(","), args.estimators.split(",")
    base = base_model_dir(args.cache, args.base_steps, args.device)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in tasks:
            for est in estimators:
                for seed in range(args.seeds):
                    r = run_one(base, task, est, seed, args, Path(tmp) / f"{task}_{est}_{seed}")
                    print(f"{task} {est} seed {seed}: Quality {r['before']['quality']['accuracy']:.1f} → "
                          f"{r['after']['quality']['accuracy']:.1f}, Speed {r['before']['speed']['accuracy']:.1f} → "
                          f"{r['after']['speed']['accuracy']:.1f} ({r['seconds']:.0f} s)", flush=True)
                    runs.append(r)
    table, summary = summarise(runs, tasks, estimators)
    print_table(f"dllm-rl: {args.steps} steps × {args.groups} prompts × {args.group_size} rollouts, lr {args.lr}, "
                f"{args.mini_batches} mini-batches, {args.eval_n} held-out problems",
                ["task", "estimator", "seeds", "Q acc before", "Q acc after", "Δ", "Q TPF before", "Q TPF after",
                 "S acc before", "S acc after", "S TPF before", "S TPF after"], table)
    targets = targets_of(summary)
    print_targets(targets)
    keys = ("steps", "groups", "group_size", "lr", "mini_batches", "temperature", "rollout_mode", "eval_n", "seeds",
            "base_steps")
    settings = {k: getattr(args, k) for k in keys}
    result = {"settings": settings, "summary": summary, "runs": runs, "targets": targets}
    write_result(args.out, "dllm-rl", result, plot(runs, tasks, estimators))
    return result


def main(args) -> None:
    run(args)


def add_arguments(p) -> None:
    p.add_argument("--cache", default="runs/dllm_cache", help="folder of the SFT base (shared with `arbor bench dllm`)")
    p.add_argument("--base-steps", type=int, default=2500, help="masked-diffusion SFT steps of the base")
    p.add_argument("--tasks", default="countdown,sudoku")
    p.add_argument("--estimators", default="ebpo,mean_field")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="RL steps per run")
    p.add_argument("--groups", type=int, default=8, help="training prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per prompt")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per RL step")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--rollout-mode", default="quality", choices=["quality", "speed", "threshold"])
    p.add_argument("--eval-n", type=int, default=200, help="held-out problems")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
