"""RL for block-diffusion models: LLaDA2.1's EBPO against ESPO and the mean-field (d1) baseline
(``arbor bench dllm-rl``).

From the SFT base of ``arbor bench dllm`` (trained once into ``--cache``, shared with that bench),
each task × estimator × seed runs ``--steps`` RL steps of ``EBPOTrainer`` (the trainer of
``arbor train`` on a block-diffusion model): ``--groups`` training prompts per step,
``--group-size`` diffusion-decoded rollouts each (``--rollout-mode``, temperature
``--temperature``), group advantages, ``--ppo-epochs`` passes of ``--mini-batches`` optimizer steps
over them (a later pass is off-policy, so the clip can bind), asymmetric clip. The estimators
(``dllm.estimator``, ``arbor.dllm.ebpo``): ``ebpo`` (one ratio per sequence, the sum of the block
ELBOs), ``espo`` (the sequence ELBO ÷ length, ESPO's antithetic draws), ``mean_field`` (per-token
ratios), and ``ebpo_block`` (a ratio per block) when asked: at block 64 every Countdown and Sudoku
response is one block, where it equals ``ebpo`` exactly. Held-out accuracy and TPF of greedy decoding
on ``--eval-n`` fixed test problems, in LLaDA2.1 Quality and Speed mode, before (the SFT base) and
after; Quality-mode accuracy every ``--eval-every`` steps for the curves. Beside them, one reference
that is not RL (``oracle_sft``, ``--oracle-steps`` > 0): the base fine-tuned with the masked-diffusion
loss on the training problems' given answers, which bounds what the same model learns when it is
told the answer instead of rewarded for finding it.

Targets (issue 39): EBPO raises Countdown's held-out accuracy (Quality mode, mean over seeds) by ≥ 10
points over the SFT base, at equal or higher TPF, and by at least as much as the mean-field baseline.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from arbor.bench.common import print_table, print_targets, target, write_result
from arbor.models import load_model
from arbor.models.tokenizer import Tokenizer
from arbor.dllm.ebpo_trainer import EBPOTrainer
from arbor.train.optim import OptimConfig
from arbor.train.config import EBPOConfig, RLConfig

EVAL_SEED = 777          # the held-out problems, the same for every run
ORACLE = "oracle_sft"    # the supervised reference system (``oracle_one``)


def base_config(hidden: int = 0, layers: int = 0):
    """The base's ``DiffusionModelConfig``: ``arbor bench dllm``'s (block 64) by default; ``hidden`` > 0 sets the
    width (intermediate 2 × hidden, heads of 32, two query heads per key-value head), ``layers`` > 0 the depth."""
    from arbor.bench.dllm import BLOCK_SIZE
    from arbor.dllm.sft import DiffusionModelConfig
    if hidden < 0 or hidden % 64 or layers < 0:
        raise ValueError(f"--base-hidden must be 0 or a positive multiple of 64 (heads of 32, two per key-value "
                         f"head) and --base-layers ≥ 0, got {hidden} and {layers}")
    size = {}
    if hidden:
        size = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=hidden // 32,
                    num_key_value_heads=hidden // 64, head_dim=32)
    if layers:
        size["num_hidden_layers"] = layers
    return DiffusionModelConfig(block_size=BLOCK_SIZE, **size)


def base_model_dir(cache: str, steps: int, device: str, log=print, hidden: int = 0, layers: int = 0) -> Path:
    """The ``arbor bench dllm`` base (all tasks, block 64; the size of ``base_config``), trained into ``cache``
    when missing; a size other than the default has its own folder."""
    from arbor.bench.dllm import BLOCK_SIZE, DATA_VERSION
    from arbor.dllm.sft import DiffusionModelConfig, DiffusionTrainConfig, train_from_config
    model = base_config(hidden, layers)
    default = model == DiffusionModelConfig(block_size=BLOCK_SIZE)
    size = "" if default else f"_h{model.hidden_size}_l{model.num_hidden_layers}"
    base = Path(cache) / f"v{DATA_VERSION}_base_b{BLOCK_SIZE}_s{steps}{size}"
    if not (base / "config.json").exists():
        cfg = DiffusionTrainConfig(steps=steps, device=device, log_every=250, model=model)
        train_from_config(cfg, out_dir=base, on_log=log)
    return base


def evaluate(trainer: EBPOTrainer, problems) -> dict:
    out = {}
    for mode in ("quality", "speed"):
        scores, results, _ = trainer.decode(problems, mode)
        out[mode] = {"accuracy": 100.0 * sum(scores) / len(scores),
                     "tpf": sum(r.num_tokens for r in results) / max(1, sum(r.forwards for r in results))}
    return out


def trainer_for(base: Path, task: str, estimator: str, seed: int, args, out: Path) -> EBPOTrainer:
    torch.manual_seed(seed)
    model = load_model(base, device=args.device).eval()
    cfg = RLConfig(model=str(base), out=str(out), task=task, seed=seed, steps=args.steps, groups_per_step=args.groups,
                   mini_batches=args.mini_batches, ppo_epochs=args.ppo_epochs, device=args.device, checkpoint_every=0,
                   resume=False, optim=OptimConfig(lr=args.lr, warmup_steps=0, min_lr_ratio=1.0),
                   dllm=EBPOConfig(estimator=estimator, group_size=args.group_size, mode=args.rollout_mode,
                                   temperature=args.temperature))
    cfg.log.progress = cfg.log.tensorboard = False
    return EBPOTrainer(cfg, model, Tokenizer.load(base), task)


def run_one(base: Path, task: str, estimator: str, seed: int, args, out: Path) -> dict:
    trainer = trainer_for(base, task, estimator, seed, args, out)
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
            "train_reward": [r["reward"] for r in rows], "clip_frac": statistics.mean(
                r.get("clip_low", 0.0) + r.get("clip_high", 0.0) for r in rows), "seconds": time.perf_counter() - t0}


def oracle_one(base: Path, task: str, args, out: Path) -> dict:
    """The reference beside RL: masked-diffusion SFT of the base on the task's *given* answers
    (``--oracle-steps`` steps × ``groups × group_size`` samples of fresh training problems, lr
    ``--oracle-lr``), what supervision teaches where RL only sees a reward; seed 0."""
    from arbor.dllm.sft import DiffusionTrainConfig, task_examples, train_diffusion
    from arbor.train.run_log import LogConfig
    trainer = trainer_for(base, task, "ebpo", 0, args, out)
    problems = trainer.task.generate(args.eval_n, seed=EVAL_SEED, split="test")
    before, t0 = evaluate(trainer, problems), time.perf_counter()
    examples = task_examples(trainer.tok, task, args.oracle_steps * args.groups, 0, "train",
                             trainer.model.config.block_size)[1]
    cfg = DiffusionTrainConfig(steps=args.oracle_steps, batch_size=args.groups * args.group_size, checkpoint_every=0,
                               device=args.device, log_every=max(1, args.oracle_steps),
                               optim=OptimConfig(lr=args.oracle_lr, warmup_steps=0, min_lr_ratio=1.0),
                               log=LogConfig(progress=False, tensorboard=False))
    trainer.model.train()
    train_diffusion(trainer.model, examples, cfg)
    trainer.model.eval()
    after = evaluate(trainer, problems)
    return {"task": task, "estimator": ORACLE, "seed": 0, "before": before, "after": after,
            "curve": [(0, before["quality"]["accuracy"]), (args.oracle_steps, after["quality"]["accuracy"])],
            "train_reward": [], "clip_frac": 0.0, "seconds": time.perf_counter() - t0}


def spread(xs: list[float]) -> float:
    """The sample standard deviation over seeds (0 for one seed)."""
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarise(runs: list[dict], tasks, estimators) -> tuple[list[list], dict]:
    """Per task × estimator the means over seeds; per task one ``sft_base`` row (the runs' common start)."""
    table, summary = [], {}
    for task in tasks:
        base = [r for r in runs if r["task"] == task]
        b = {f"{mode}_{key}": statistics.mean(r["before"][mode][key] for r in base)
             for mode in ("quality", "speed") for key in ("accuracy", "tpf")}
        summary[f"{task}/sft_base"] = b
        table.append([task, "SFT base", "–", b["quality_accuracy"], "–", "–", b["quality_tpf"], b["speed_accuracy"],
                      b["speed_tpf"]])
        for est in estimators:
            rs = [r for r in base if r["estimator"] == est]
            m = lambda when, mode, key: statistics.mean(r[when][mode][key] for r in rs)
            s = {f"{when}_{mode}_{key}": m(when, mode, key) for when in ("before", "after")
                 for mode in ("quality", "speed") for key in ("accuracy", "tpf")}
            s["delta_quality"] = s["after_quality_accuracy"] - s["before_quality_accuracy"]
            s["delta_speed"] = s["after_speed_accuracy"] - s["before_speed_accuracy"]
            s["delta_quality_per_seed"] = [r["after"]["quality"]["accuracy"] - r["before"]["quality"]["accuracy"] for r in rs]
            s["delta_quality_sd"] = spread(s["delta_quality_per_seed"])
            s["clip_frac"] = statistics.mean(r["clip_frac"] for r in rs)
            summary[f"{task}/{est}"] = s
            table.append([task, est, len(rs), s["after_quality_accuracy"], s["delta_quality"], s["delta_quality_sd"],
                          s["after_quality_tpf"], s["after_speed_accuracy"], s["after_speed_tpf"]])
    return table, summary


def targets_of(summary: dict) -> list[dict]:
    e, mf = summary.get("countdown/ebpo"), summary.get("countdown/mean_field")
    out = []
    if e:
        out.append(target("EBPO Countdown Δ held-out acc over the SFT base, Quality (points, mean of seeds)",
                          e["delta_quality"], "≥ 10", e["delta_quality"] >= 10))
        ratio = e["after_quality_tpf"] / e["before_quality_tpf"]
        out.append(target("EBPO Countdown TPF after ÷ before, Quality", ratio, "≥ 1 (equal or higher)", ratio >= 1.0))
    if e and mf:
        gap = e["delta_quality"] - mf["delta_quality"]
        out.append(target("EBPO − mean-field Countdown Δ acc, Quality (points)", gap, "≥ 0", gap >= 0))
    return out


def plot(runs, tasks, estimators):
    def draw(plt):
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 3.6), squeeze=False)
        colours = {"ebpo": "tab:blue", "ebpo_block": "tab:purple", "espo": "tab:green", "mean_field": "tab:orange"}
        for ax, task in zip(axes[0], tasks):
            for est in estimators:
                rs = [r for r in runs if r["task"] == task and r["estimator"] == est]
                for r in rs:
                    ax.plot(*zip(*r["curve"]), color=colours.get(est), alpha=0.3, lw=1)
                if rs:
                    steps = [s for s, _ in rs[0]["curve"]]
                    mean = [statistics.mean(r["curve"][i][1] for r in rs) for i in range(len(steps))]
                    ax.plot(steps, mean, "o-", color=colours.get(est), label=f"{est} (mean of {len(rs)})")
            for r in (r for r in runs if r["task"] == task and r["estimator"] == ORACLE):
                ax.axhline(r["after"]["quality"]["accuracy"], color="grey", ls="--", lw=1,
                           label=f"SFT on the answers, {r['curve'][-1][0]} steps")
            ax.axhline(runs[0]["before"]["quality"]["accuracy"] + 10, color="tab:red", ls=":", lw=1, label="target: base + 10")
            ax.set_title(f"{task}: held-out accuracy, Quality mode")
            ax.set_xlabel("RL step")
            ax.set_ylabel("accuracy %")
            ax.legend(fontsize=7)
        return fig
    return draw


def run(args) -> dict:
    """The bench; → its JSON result."""
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks, estimators = args.tasks.split(","), args.estimators.split(",")
    base = base_model_dir(args.cache, args.base_steps, args.device, hidden=args.base_hidden, layers=args.base_layers)
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
            if args.oracle_steps:
                runs.append(oracle_one(base, task, args, Path(tmp) / f"{task}_{ORACLE}"))
                print(f"{task} {ORACLE}: Quality {runs[-1]['before']['quality']['accuracy']:.1f} → "
                      f"{runs[-1]['after']['quality']['accuracy']:.1f} ({runs[-1]['seconds']:.0f} s)", flush=True)
    table, summary = summarise(runs, tasks, estimators + [ORACLE] * bool(args.oracle_steps))
    print_table(f"dllm-rl: {args.steps} steps × {args.groups} prompts × {args.group_size} rollouts, lr {args.lr}, "
                f"{args.mini_batches} mini-batches × {args.ppo_epochs} epochs, {args.eval_n} held-out problems",
                ["task", "system", "seeds", "Q acc", "Δ Q acc (mean)", "Δ sd", "Q TPF", "S acc", "S TPF"], table)
    targets = targets_of(summary)
    print_targets(targets)
    keys = ("tasks", "estimators", "steps", "groups", "group_size", "lr", "mini_batches", "ppo_epochs", "temperature",
            "rollout_mode", "eval_n", "seeds", "base_steps", "base_hidden", "base_layers", "oracle_steps",
            "oracle_lr")
    settings = {k: getattr(args, k) for k in keys}
    result = {"settings": settings, "summary": summary, "runs": runs, "targets": targets}
    write_result(args.out, "dllm-rl", result, plot(runs, tasks, estimators))
    return result


def main(args) -> None:
    run(args)


def add_arguments(p) -> None:
    p.add_argument("--cache", default="runs/dllm_cache", help="folder of the SFT base (shared with `arbor bench dllm`)")
    p.add_argument("--base-steps", type=int, default=2500, help="masked-diffusion SFT steps of the base")
    p.add_argument("--base-hidden", type=int, default=0, help="the base's width, a multiple of 64 (0: 128)")
    p.add_argument("--base-layers", type=int, default=0, help="the base's layers (0: 3)")
    p.add_argument("--tasks", default="countdown", help="comma-separated: countdown, sudoku, addition")
    p.add_argument("--estimators", default="ebpo,espo,mean_field", help="comma-separated dllm.estimator values")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=100, help="RL steps per run")
    p.add_argument("--groups", type=int, default=16, help="training prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per prompt")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per pass over a step's rollouts")
    p.add_argument("--ppo-epochs", type=int, default=2, help="passes over each step's rollouts (later ones off-policy)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--rollout-mode", default="quality", choices=["quality", "speed", "threshold"])
    p.add_argument("--eval-n", type=int, default=500, help="held-out problems")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--oracle-steps", type=int, default=400, help="SFT steps of the supervised reference (0: none)")
    p.add_argument("--oracle-lr", type=float, default=3e-4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
