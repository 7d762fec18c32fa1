"""Where an RL step's samples train: the data-parallel layout (``plan.layout``, ``plan.routepack``).

Each rank rolls out its own groups and takes their advantages there (a group is whole on the rank that
rolled it out). The step's optimizer steps are its ``mini_batches`` parts: part k of the step is part k
of every rank (``PolicyUpdate.mini_batches``: whole groups, round-robin). A layout says, for each part,
which rank trains which sample in which micro-batch. The unit of a layout is a trajectory, or in tree
mode (``tree.enabled``) a whole group weighted by its compact tokens (each shared prefix once), since a
group's tree trains in one micro-batch.

- ``local``: the rank that rolled a sample out trains it; micro-batches are first-fit-decreasing bins of
  ≤ ``tree.token_cap`` tokens. Nothing moves between ranks.
- ``lpt``: every rank's units of the part go to ranks by greedy LPT on their tokens, then into
  token-capped micro-batches on each rank (``tree_plan.plan_rows``): the ranks' token totals differ by
  at most the largest unit.
- ``kk``: verl's balancing, Karmarkar–Karp over ranks and micro-batches on w = c·n + n²
  (``arbor.plan.baselines.kk_workload``); experts stay where they are.
- ``routepack`` (``plan.routepack=true``): RoutePack's plan from the samples' replayed expert ids
  (``arbor.train.routepack_hook``): experts placed for the step and migrated before its first pass,
  rows packed and laid out per part.

``auto``: routepack with ``plan.routepack``, else lpt in tree mode on several ranks, else local.

A layout other than local moves samples: every rank sends its step's samples (trajectory, advantage,
part) to all (``all_gather_object``), rank 0 plans and broadcasts the plan. The update's loss is a mean
over all ranks' samples, so a layout changes only which rank sums which term: the update equals
local's up to summation order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from arbor.train.tree_batch import build_tree
from arbor.train.tree_plan import plan_rows

LAYOUTS = ("auto", "local", "lpt", "kk")


@dataclass
class StepLayout:
    """The trajectories this rank trains, their advantages, and per optimizer step (part) its
    micro-batches as indices into ``trajs``."""
    trajs: list
    adv: torch.Tensor
    minis: list[list[list[int]]]
    stats: dict = field(default_factory=dict)

    @property
    def micros(self) -> list[list[int]]:
        return [m for mini in self.minis for m in mini]


def resolve(cfg, world_size: int) -> str:
    """``plan.layout`` (and ``plan.routepack``) → the layout this run uses."""
    if cfg.plan.routepack:
        return "routepack"
    if cfg.plan.layout != "auto":
        return cfg.plan.layout
    return "lpt" if cfg.tree.enabled and world_size > 1 else "local"


def local_layout(update, trajs, adv) -> StepLayout:
    minis = []
    for part in update.mini_batches(trajs):
        minis.append([[part[i] for i in m] for m in update.micro_batches([trajs[i] for i in part])])
    return StepLayout(trajs, adv, minis)


def units(trajs, idx: list[int], tree: bool) -> tuple[list[list[int]], list[int]]:
    """Indices ``idx`` of ``trajs`` → (units: a trajectory each, or whole groups in tree mode; their tokens)."""
    if not tree:
        return [[i] for i in idx], [len(trajs[i].tokens) for i in idx]
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(trajs[i].group, []).append(i)
    out = list(groups.values())
    return out, [build_tree([trajs[i].tokens for i in u]).num_tokens for u in out]


def kk_cells(tokens: list[int], world: int, cap: int, cost) -> list[list[list[int]]]:
    """Karmarkar–Karp cells (``kk_workload``; no expert counts: it keeps the static placement); a unit
    above the cap → LPT's cells."""
    import numpy as np

    from arbor.plan import Sample, kk_workload
    if max(tokens) > cap:
        return plan_rows(tokens, world, cap)
    plan = kk_workload([Sample(n, np.zeros((1, 1))) for n in tokens], 1, world, cap, cost)
    return [[c for c in rank if c] for rank in plan.cells]


def global_layout(update, trajs, adv, kind: str) -> StepLayout:
    """Gather every rank's samples, plan on rank 0 (``kind``: lpt | kk | routepack), keep this rank's cells."""
    ctx = update.ctx
    t0 = time.perf_counter()
    part_of = {i: k for k, part in enumerate(update.mini_batches(trajs)) for i in part}
    sent = [(t, float(adv[i]), part_of[i]) for i, t in enumerate(trajs)]
    every = [x for rank in ctx.all_gather_object(sent, "step samples") for x in rank]
    plan = None
    if ctx.is_main:
        plan = plan_step(update, [t for t, _, _ in every], [k for _, _, k in every], kind)
    plan = ctx.broadcast_object(plan, 0, "step plan")
    stats = dict(plan["stats"])
    if plan.get("placements") is not None:
        stats.update(update.routepack.apply(plan["placements"]))
    mine, minis = [], []
    for cells in plan["cells"]:                       # per part: cells[rank][micro] = global sample indices
        micros = []
        for cell in cells[ctx.rank]:
            micros.append(list(range(len(mine), len(mine) + len(cell))))
            mine += cell
        minis.append(micros)
    tokens = [sum(len(every[i][0].tokens) for part in plan["cells"] for c in part[r] for i in c)
              for r in range(ctx.world_size)]
    stats.update(layout_s=time.perf_counter() - t0, rank_tokens_max_over_mean=balance(tokens))
    return StepLayout([every[i][0] for i in mine], torch.tensor([every[i][1] for i in mine], dtype=torch.float32),
                      minis, stats)


def plan_step(update, trajs, part: list[int], kind: str) -> dict:
    """Rank 0's plan of the step: → {"cells": per part cells[rank][micro] = sample indices,
    "placements": RoutePack's new expert placement or None, "stats": …}."""
    cfg, world = update.cfg, update.ctx.world_size
    parts = [[i for i in range(len(trajs)) if part[i] == k] for k in range(max(part, default=-1) + 1)]
    per_part = [units(trajs, idx, cfg.tree.enabled) for idx in parts]
    t0 = time.perf_counter()
    stats, placements, unit_cells = {}, None, None
    if kind == "routepack":
        unit_cells, placements, stats = update.routepack.plan(trajs, per_part, update.step)
    if unit_cells is None:
        cap = cfg.tree.token_cap
        make = (lambda tok: kk_cells(tok, world, cap, update.routepack.cost)) if kind == "kk" else \
            (lambda tok: plan_rows(tok, world, cap))
        unit_cells = [make(tok) for _, tok in per_part]
    cells = [[[[i for u in cell for i in us[u]] for cell in rank] for rank in uc]
             for (us, _), uc in zip(per_part, unit_cells)]
    stats["plan_s"] = time.perf_counter() - t0
    return {"cells": cells, "placements": placements, "stats": stats}


def lay_out(update, trajs, adv) -> StepLayout:
    """This step's layout (module docstring) of this rank's ``trajs`` with their advantages ``adv``. Its
    stats, logged with the step: ``layout_s`` (gathering, planning, broadcasting, RoutePack's migration),
    ``plan_s`` (rank 0's planning), ``rank_tokens_max_over_mean``, and RoutePack's own."""
    kind = resolve(update.cfg, update.ctx.world_size)
    if kind != "local" and update.ctx.distributed:
        return global_layout(update, trajs, adv, kind)
    t0 = time.perf_counter()
    layout = local_layout(update, trajs, adv)
    tokens = update.ctx.all_gather_object(sum(len(t.tokens) for t in trajs), "step tokens")
    layout.stats.update(layout_s=time.perf_counter() - t0, plan_s=0.0, rank_tokens_max_over_mean=balance(tokens))
    return layout


def balance(tokens: list[int]) -> float:
    """max ÷ mean of the ranks' trained tokens (1: balanced)."""
    return max(tokens) * len(tokens) / max(1, sum(tokens))
