"""One full RL step on the tiny model, split into phases (``arbor bench rl``).

8 prompts × 4 samples, 32 new tokens each (EOS ignored), synchronous: rollout (engine),
log-prob recompute, training (forward + backward + AdamW) and weight sync, each timed; medians
over ``repeats`` steps after a warm-up step. Tokens/s = trained tokens ÷ phase time.
"""

from __future__ import annotations

import asyncio

from arbor.bench.common import median, print_table, print_targets, target, write_result
from arbor.bench.rl_setup import make_trainer, tiny_model
from arbor.rollout.collector import RolloutConfig
from arbor.tasks.longtail import LongTailProblem
from arbor.train.rl import C3POConfig, RLConfig

PHASES = ["rollout_s", "recompute_s", "train_s", "sync_s"]


def run(out_dir="bench_results", repeats=5, device="cpu", seed=0, engine_dtypes=("float32", "bfloat16")):
    model, tok = tiny_model(seed=seed, device=device)
    result, rows = {"config": {"prompts": 8, "samples": 4, "new_tokens": 32}, "systems": {}}, []
    for dtype in engine_dtypes:
        cfg = RLConfig(task="longtail", seed=seed, device=device, groups_per_step=8, checkpoint_every=0,
                       engine_dtype=dtype, c3po=C3POConfig(enabled=False),
                       rollout=RolloutConfig(max_turn_tokens=32, max_context=200, branch=[4]))
        trainer = make_trainer(cfg, model, tok)
        trainer.problems = [LongTailProblem(p.letter, 32) for p in trainer.problems]
        hist = [asyncio.run(trainer.train_step()) for _ in range(repeats + 1)][1:]
        med = {k: median([r[k] for r in hist]) for k in PHASES}
        tokens = median([r["tokens"] for r in hist])
        total = sum(med.values())
        result["systems"][f"engine {dtype}"] = {"median_s": med, "tokens_per_step": tokens,
                                                 "tokens_per_s": tokens / total, "history": hist}
        rows.append([f"engine {dtype}"] + [1e3 * med[k] for k in PHASES] + [tokens / total])
    print_table(f"one RL step (8x4 samples, 32 tokens), {device}, median of {repeats}",
                ["system", "rollout ms", "recompute ms", "train ms", "sync ms", "tokens/s"], rows)
    share = {name: s["median_s"]["sync_s"] / sum(s["median_s"].values()) for name, s in result["systems"].items()}
    result["targets"] = [target(f"{name}: weight sync share of the step (in place, ASystem)", v, "<= 0.02", v <= 0.02)
                         for name, v in share.items()]
    print_targets(result["targets"])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        left = [0.0] * len(rows)
        for j, k in enumerate(PHASES):
            vals = [r[1 + j] for r in rows]
            ax.barh([r[0] for r in rows], vals, left=left, label=k[:-2])
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel("ms per RL step (median)")
        ax.legend()
        return fig

    write_result(out_dir, "rl", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=5)


def main(args) -> None:
    run(out_dir=args.out, repeats=args.repeats, device=args.device)
