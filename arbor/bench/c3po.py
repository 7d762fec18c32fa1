"""Synchronous rollouts vs C3PO++ token-budget partitioning on long-tailed lengths (``arbor bench c3po``).

Both runs start from the same tiny model on the ``longtail`` task (output lengths with a
Pareto tail) and train on the same number of samples. Synchronous: each step starts
``groups`` groups and waits for the longest. C3PO++: each step generates until finished groups
hold Φ = groups × samples × mean length tokens, with Ω = 2 × groups groups in flight and σ = 2.
Reported: rollout-phase seconds per trained sample and per step, tokens per update, reward.
"""

from __future__ import annotations

import asyncio

from arbor.bench.common import median, print_table, print_targets, target, write_result
from arbor.bench.rl_setup import make_trainer, tiny_model
from arbor.rollout.collector import RolloutConfig
from arbor.tasks.longtail import generate_problems
from arbor.train.optim import OptimConfig
from arbor.train.config import C3POConfig, RLConfig


def run_until(trainer, samples: int) -> list[dict]:
    rows = []

    async def go():
        while sum(r.get("samples", 0) for r in rows) < samples:
            rows.append(await trainer.train_step())

    asyncio.run(go())
    return rows


def run(out_dir="bench_results", groups=8, branch=4, samples=256, device="cpu", seed=0):
    model, tok = tiny_model(seed=seed, device=device)
    mean_len = sum(p.length for p in generate_problems(2000, seed)) / 2000
    base = dict(task="longtail", seed=seed, device=device, groups_per_step=groups, checkpoint_every=0,
                rollout=RolloutConfig(max_turn_tokens=256, max_context=400, temperature=1.0, branch=[branch]),
                optim=OptimConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0))
    budget = int(groups * branch * mean_len)
    systems = {
        "synchronous": RLConfig(**base, c3po=C3POConfig(enabled=False)),
        "c3po++": RLConfig(**base, c3po=C3POConfig(enabled=True, token_budget=budget, capacity=2 * groups, max_age=2)),
    }
    result = {"config": {"groups": groups, "branch": branch, "samples": samples, "token_budget": budget,
                         "mean_length": mean_len}, "systems": {}}
    rows = []
    for name, cfg in systems.items():
        hist = run_until(make_trainer(cfg, model, tok), samples)
        trained = sum(r["samples"] for r in hist)
        t_roll = sum(r["rollout_s"] for r in hist)
        tokens = [r.get("tokens", 0) for r in hist]
        result["systems"][name] = {"history": hist, "rollout_s_total": t_roll, "samples": trained,
                                   "rollout_s_per_sample": t_roll / trained, "median_rollout_s_per_step": median([r["rollout_s"] for r in hist]),
                                   "tokens_per_update": median(tokens), "final_reward": hist[-1]["reward"]}
        rows.append([name, len(hist), trained, t_roll, 1e3 * t_roll / trained, median(tokens), hist[-1]["reward"]])
    s, c = result["systems"]["synchronous"], result["systems"]["c3po++"]
    result["rollout_speedup_per_sample"] = s["rollout_s_per_sample"] / c["rollout_s_per_sample"]
    print_table(f"rollout phase, longtail task, {samples} trained samples, {device}",
                ["system", "steps", "samples", "rollout s", "ms/sample", "tokens/update", "final reward"], rows)
    print(f"C3PO++ rollout speedup per trained sample: {result['rollout_speedup_per_sample']:.2f}x")
    late = lambda h: median([r["reward"] for r in h[-max(1, len(h) // 2):]])     # rewards over the second half
    rs, rc = late(s["history"]), late(c["history"])
    result["targets"] = [
        target("C3PO++ rollout speedup per trained sample", result["rollout_speedup_per_sample"], ">= 2",
               result["rollout_speedup_per_sample"] >= 2),
        target("C3PO++ reward (second-half median) − synchronous", rc - rs, "within ± 0.05 (noise)", abs(rc - rs) <= 0.05)]
    print_targets(result["targets"])

    def plot(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        for name, sysr in result["systems"].items():
            h = sysr["history"]
            a.plot([r["rollout_s"] for r in h], label=name)
            b.plot([sum(x["samples"] for x in h[:i + 1]) for i in range(len(h))], [r["reward"] for r in h], label=name)
        a.set_xlabel("step"), a.set_ylabel("rollout s / step"), a.legend()
        b.set_xlabel("trained samples"), b.set_ylabel("reward"), b.legend()
        return fig

    write_result(out_dir, "c3po", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=256)


def main(args) -> None:
    run(out_dir=args.out, groups=args.groups, samples=args.samples, device=args.device)
