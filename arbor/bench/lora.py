"""How rollouts use a LoRA policy (`arbor bench lora`): the adapter merged into the engine's own
copy at each weight sync (what `arbor train lora.rank=R` does: `arbor.train.lora`) against the
adapter applied in the engine's forward (the engine serves the trainer's module, so a sync moves
nothing but every decode step runs two extra small GEMMs per adapted linear).

Both run `--steps` RL steps of `--groups` groups on `--task` from the same random `--preset` model
and the same adapters (rank `--rank` on every attention and MLP projection), float32, one process;
the systems alternate for `--rounds` rounds. Reported per system: median RL step, rollout and sync
seconds over the steps after each round's first, and the ratio merged / in-forward.

Target (issue 38: "measure which is faster per RL step and keep it"): the kept design, merged,
takes ≤ 1.0× the in-forward step.
"""

from __future__ import annotations

import asyncio
import copy
import time

import torch

from arbor.bench.common import median, print_table, print_targets, target, write_result

SYSTEMS = ("merged", "in-forward")


def add_arguments(p) -> None:
    p.add_argument("--preset", default="tiny", help="the random model's preset (arbor.models.presets)")
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="RL steps per system and round (the first is not timed)")
    p.add_argument("--groups", type=int, default=8, help="groups per step")
    p.add_argument("--rounds", type=int, default=2)


def _trainer(system: str, args, model, tok):
    import dataclasses

    from arbor.models.lora import LoRAConfig, apply_lora
    from arbor.train.config import RLConfig, engine_config
    from arbor.train.rl import RLTrainer
    from arbor.train.run import make_engine, rl_task
    cfg = RLConfig(task=args.task, groups_per_step=args.groups, steps=args.steps, checkpoint_every=0, out="runs/bench-lora")
    cfg.lora = LoRAConfig(rank=args.rank)
    cfg.c3po.enabled = False
    model = copy.deepcopy(model)
    engine, sampling = make_engine(model, tok, dataclasses.replace(engine_config(cfg), share_weights=system == "in-forward"))
    apply_lora(model, cfg.lora)                 # in-forward: the shared module now runs its adapters in the engine too
    model.lora_base = "unused"
    torch.manual_seed(0)
    trainer = RLTrainer(cfg, model, tok, engine, sampling, rl_task(cfg, tok))
    if system == "in-forward":                  # nothing to send: the engine runs the trainer's own adapters
        def sync_nothing() -> float:
            trainer.collector.version += 1
            return 0.0
        trainer.sync_weights = sync_nothing
    return trainer


def main(args) -> None:
    from arbor.bench.rl_setup import tiny_model
    if args.steps < 2 or args.rounds < 1 or args.rank < 1 or args.groups < 1:
        raise ValueError("--steps must be ≥ 2 and --rounds, --rank, --groups ≥ 1")
    model, tok = tiny_model(args.preset)
    rows = {s: [] for s in SYSTEMS}
    for _ in range(args.rounds):
        for system in SYSTEMS:
            trainer = _trainer(system, args, model, tok)
            steps = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                row = asyncio.run(trainer.train_step())
                steps.append(row | {"step_s": time.perf_counter() - t0})
            rows[system] += steps[1:]
    res = {s: {k: median([r[k] for r in rows[s]]) for k in ("step_s", "rollout_s", "sync_s", "train_s")} for s in SYSTEMS}
    base = res["in-forward"]["step_s"]
    print_table(f"RL step with LoRA rank {args.rank}, preset {args.preset}, {args.groups} groups (medians)",
                ["system", "step s", "rollout s", "sync s", "train s", "step / in-forward"],
                [[s, r["step_s"], r["rollout_s"], r["sync_s"], r["train_s"], r["step_s"] / base] for s, r in res.items()])
    ratio = res["merged"]["step_s"] / base
    targets = [target("merged-at-sync RL step / adapters-in-forward's", ratio, "<= 1.0", ratio <= 1.0)]
    print_targets(targets)

    def plot(plt):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for i, key in enumerate(("rollout_s", "sync_s", "train_s")):
            ax.bar([x + 0.27 * i for x in range(len(SYSTEMS))], [res[s][key] for s in SYSTEMS], width=0.27, label=key)
        ax.set_xticks([x + 0.27 for x in range(len(SYSTEMS))], list(SYSTEMS))
        ax.set_ylabel("median seconds per RL step")
        ax.legend()
        return fig
    write_result(args.out, "lora", {"config": vars(args), "results": res, "targets": targets}, plot)
