"""RoutePack: expert placement, certified row packing and an annealed DP layout for one window.

``routepack(samples, ep_size, dp_size, token_cap) -> Plan``:

1. placement per MoE layer from the window's demand d_l[e] = Σ_i counts_i[l, e]
   (``placement.balanced``; experts kept where ``current`` has them as far as the balance allows),
   then, once 2-4 have laid the window out, refined on the layout's slots (``placement.refine``:
   the cost model's Σ_s max_r term) and every step's layout annealed again under it, starting from
   the first layout (same rows; ``warm_config``: the colder half of the temperatures); the better
   window is kept (``plan_window``);
2. rows: the samples packed into the fewest token-capped rows found, certified against
   max(L1, L2) (``packing.pack_rows``);
3. grid: S = ⌈R / D⌉ slots per DP rank; the D·S − R missing rows come from splitting the rows with
   the most tokens (≥ 2 samples each) in two; rows sorted by attention cost fill the slots D at a
   time (similar rows share a slot); raises when there are fewer samples than cells;
4. layout: population annealing on the modeled step time (``layout.anneal``), never worse than 3.

Invariants of every Plan: every sample in exactly one cell, every cell non-empty and within the
token cap, S cells on every DP rank, one placement per MoE layer with E / ep_size experts per rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from arbor.plan import placement as pl
from arbor.plan.cost import CostModel
from arbor.plan.layout import AnnealConfig, Problem, anneal, check_layout, energy
from arbor.plan.packing import Packing, lower_bound_l1, pack_rows


@dataclass
class Sample:
    length: int
    expert_counts: np.ndarray          # [Lm, E]: routed copies of this sample's tokens per expert and MoE layer

    @classmethod
    def from_ids(cls, ids, num_experts: int) -> "Sample":
        """ids [Lm, T, k] (routing replay's expert ids; −1 = unknown, not counted)."""
        ids = np.asarray(ids)
        counts = np.stack([np.bincount(layer[layer >= 0].ravel(), minlength=num_experts) for layer in ids])
        return cls(int(ids.shape[1]), counts)


@dataclass
class Plan:
    method: str
    cells: list[list[list[int]]]       # cells[d][s]: sample indices of DP rank d's micro-batch s
    placements: list[pl.Placement]     # one per MoE layer
    energy: float                      # modeled step time, seconds (arbor.plan.cost)
    packing: Packing | None = None     # the certified row count (RoutePack only)
    stats: dict = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return len(self.cells[0]) if self.cells else 0

    def to_json(self) -> dict:
        return {"method": self.method, "cells": self.cells, "energy": self.energy,
                "placements": [{"rank_of": p.rank_of, "slot_of": p.slot_of} for p in self.placements],
                "packing": None if self.packing is None else {
                    "rows": len(self.packing.rows), "l1": self.packing.l1, "l2": self.packing.l2,
                    "certified": self.packing.certified, "status": self.packing.status},
                "stats": self.stats}


def demand(samples: list[Sample]) -> np.ndarray:
    """[Lm, E] routed copies per expert over the window."""
    return np.sum([s.expert_counts for s in samples], axis=0)


def problem(samples: list[Sample], placements: list[pl.Placement], dp_size: int, slots: int, ep_size: int,
            cap: int, cost: CostModel) -> Problem:
    lengths = np.array([s.length for s in samples], dtype=np.int64)
    counts = np.stack([s.expert_counts for s in samples]).astype(float)        # [N, Lm, E]
    loads = np.stack([pl.rank_loads(counts[:, l], p.rank_of, ep_size) for l, p in enumerate(placements)], 1)
    return Problem(lengths, cost.attention(lengths), loads, dp_size, slots, ep_size, cap, cost.e, cost.c0)


def cells_of(cell_of: np.ndarray, dp_size: int, slots: int) -> list[list[list[int]]]:
    out = [[[] for _ in range(slots)] for _ in range(dp_size)]
    for i, c in enumerate(np.asarray(cell_of).tolist()):
        out[c // slots][c % slots].append(i)
    return out


def check_sizes(samples, ep_size: int, dp_size: int, token_cap: int) -> None:
    if ep_size < 1 or dp_size < 1 or dp_size % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide dp_size {dp_size} (EP groups of consecutive DP ranks)")
    if not samples:
        raise ValueError("a window needs at least one sample")
    if len({s.expert_counts.shape for s in samples}) != 1:
        raise ValueError("every sample needs expert counts of one shape [MoE layers, experts]")
    long = [s.length for s in samples if not 1 <= s.length <= token_cap]
    if long:
        raise ValueError(f"samples of length {sorted(long)[-3:]} do not fit the token cap {token_cap}")


def grid_start(rows: list[list[int]], lengths: np.ndarray, attn: np.ndarray, dp_size: int) -> np.ndarray:
    """Rows → the starting layout (step 3 of the module docstring) as cell_of [N]."""
    rows = [list(r) for r in rows]
    slots = -(-len(rows) // dp_size)
    while len(rows) < dp_size * slots:
        splittable = [k for k, r in enumerate(rows) if len(r) >= 2]
        if not splittable:
            raise ValueError(f"{len(lengths)} samples cannot fill {dp_size} x {slots} non-empty micro-batches")
        k = max(splittable, key=lambda k: (lengths[rows[k]].sum(), -k))
        halves: list[list[int]] = [[], []]
        for i in sorted(rows[k], key=lambda i: (-lengths[i], i)):           # greedy two-way balance
            halves[int(lengths[halves[1]].sum() < lengths[halves[0]].sum())].append(i)
        rows[k] = halves[0]
        rows.append(halves[1])
    order = sorted(range(len(rows)), key=lambda k: (-attn[rows[k]].sum(), k))
    cell_of = np.empty(len(lengths), dtype=np.int64)
    for pos, k in enumerate(order):
        s, d = divmod(pos, dp_size)
        d = d if s % 2 == 0 else dp_size - 1 - d                           # snake over the ranks
        cell_of[rows[k]] = d * slots + s
    return cell_of


def place(samples: list[Sample], ep_size: int, current: list[list[int]] | None = None,
          tolerance: float = 0.0) -> list[pl.Placement]:
    """Step 1: a balanced placement per MoE layer from the samples' aggregate demand; with ``current``,
    as few experts moved as the balance allows (max load within ``tolerance`` of the fresh one's)."""
    d = demand(samples)
    return [pl.balanced(d[l], ep_size, None if current is None else current[l], tolerance=tolerance)
            for l in range(len(d))]


def routepack(samples: list[Sample], ep_size: int, dp_size: int, token_cap: int, cost: CostModel | None = None,
              current: list[list[int]] | None = None, anneal_cfg: AnnealConfig | None = None,
              placements: list[pl.Placement] | None = None, tolerance: float = 0.0, move_s: float = 0.0,
              move_layer_s: float = 0.0) -> Plan:
    """The RoutePack plan of one window (see module docstring). ``current``: each MoE layer's present
    ``rank_of`` (experts kept there while the max load stays within ``tolerance`` of the balanced
    one's). ``placements``: use these (e.g. one placement for a window of several steps, each step
    packed and laid out on its own; see ``plan_window``) instead of step 1 and its refinement."""
    if placements is not None:
        return _plan_step(samples, placements, ep_size, dp_size, token_cap, cost, anneal_cfg)
    return plan_window([samples], ep_size, dp_size, token_cap, cost, current, anneal_cfg, tolerance, move_s,
                       move_layer_s)[0]


def _plan_step(samples, places, ep_size, dp_size, token_cap, cost, anneal_cfg, warm: Plan | None = None) -> Plan:
    """Steps 2-4 for one step's samples under fixed placements. ``warm``: a plan of the same samples
    under other placements; its rows are reused and its layout is the annealing's start (rows and
    layout constraints do not depend on the placement), annealed by ``warm_config``."""
    t1 = time.perf_counter()
    check_sizes(samples, ep_size, dp_size, token_cap)
    cost = cost or CostModel.load()
    packing = warm.packing if warm is not None else pack_rows([s.length for s in samples], token_cap)
    t2 = time.perf_counter()
    slots = -(-len(packing.rows) // dp_size)
    prob = problem(samples, places, dp_size, slots, ep_size, token_cap, cost)
    if warm is None:
        best, stats = anneal(prob, grid_start(packing.rows, prob.lengths, prob.attn, dp_size), anneal_cfg)
    else:
        start = np.empty(len(samples), dtype=np.int64)
        for d, row in enumerate(warm.cells):
            for s, members in enumerate(row):
                start[members] = d * slots + s
        best, stats = anneal(prob, start, warm_config(anneal_cfg))
    check_layout(prob, best)
    t3 = time.perf_counter()
    stats.update(packing_s=t2 - t1, layout_s=t3 - t2, planner_s=t3 - t1)
    return Plan("routepack", cells_of(best, dp_size, slots), places, energy(prob, best), packing, stats)


def warm_config(cfg: AnnealConfig | None) -> AnnealConfig:
    """Annealing from a layout that is already good (the first pass's, under a refined placement):
    only the colder half of ``cfg``'s temperatures (β from √(β_lo·β_hi) up), so local fixes, not a
    new search."""
    cfg = cfg or AnnealConfig()
    return AnnealConfig(population=cfg.population, levels=max(1, cfg.levels // 2), sweeps=cfg.sweeps,
                        beta_lo=float(np.sqrt(cfg.beta_lo * cfg.beta_hi)), beta_hi=cfg.beta_hi, seed=cfg.seed)


def slot_counts(plan: Plan, samples: list[Sample], ep_size: int) -> np.ndarray:
    """[S·G, Lm, E]: routed copies per expert of each (slot, EP group) of ``plan``: what one MoE
    exchange of that slot carries."""
    out = []
    for g in range(len(plan.cells) // ep_size):
        for s in range(plan.slots):
            out.append(sum(samples[i].expert_counts for d in range(g * ep_size, (g + 1) * ep_size)
                           for i in plan.cells[d][s]))
    return np.asarray(out, dtype=float)


def moved(placements: list[pl.Placement], current: list[list[int]] | None) -> int:
    """Experts (over all MoE layers) that change rank from ``current`` to ``placements``."""
    if current is None:
        return 0
    return int(sum(np.sum(np.asarray(p.rank_of) != np.asarray(c)) for p, c in zip(placements, current)))


def migration_cost(placements: list[pl.Placement], current: list[list[int]] | None, move_s: float,
                   move_layer_s: float = 0.0) -> float:
    """Modeled seconds of migrating from ``current`` to ``placements``: ``move_s`` per expert that
    changes rank, ``move_layer_s`` per MoE layer with any (``arbor.plan.cost``)."""
    if current is None:
        return 0.0
    per_layer = [int(np.sum(np.asarray(p.rank_of) != np.asarray(c))) for p, c in zip(placements, current)]
    return move_s * sum(per_layer) + move_layer_s * sum(m > 0 for m in per_layer)


def window_cost(plans: list[Plan], current: list[list[int]] | None, move_s: float, move_layer_s: float = 0.0) -> float:
    """Modeled seconds of a window: its steps' energies plus the migration into it (``migration_cost``)."""
    return sum(p.energy for p in plans) + migration_cost(plans[0].placements, current, move_s, move_layer_s)


def plan_window(steps: list[list[Sample]], ep_size: int, dp_size: int, token_cap: int,
                cost: CostModel | None = None, current: list[list[int]] | None = None,
                anneal_cfg: AnnealConfig | None = None, tolerance: float = 0.0, move_s: float = 0.0,
                move_layer_s: float = 0.0) -> list[Plan]:
    """One placement for a window of optimizer steps, each step packed and laid out on its own.

    1. ``place`` on the window's aggregate demand (moves from ``current`` kept within ``tolerance``);
    2. every step packed and laid out under it (``_plan_step``);
    3. ``placement.refine`` on the EP term of those layouts' slots (Σ over the window's slots of each
       layer's EP peak: what the cost model charges; with ``current``, plus ``move_s`` seconds per
       expert away from its current rank and ``move_layer_s`` per layer with any: what migrating
       costs, ``migration_cost``); then every step's layout of 2 is
       re-scored under the refined placement and annealed from there (rows reused; ``warm_config``:
       the colder half of the temperatures); the refined plans are kept only when the window's
       modeled time (``window_cost``: Σ of the steps' energies + ``migration_cost``) is lower, so
       refining never makes a window worse.
    → one Plan per step, all with the same placements."""
    for name, value in (("tolerance", tolerance), ("move_s", move_s), ("move_layer_s", move_layer_s)):
        if not (value >= 0 and np.isfinite(value)):
            raise ValueError(f"plan_window: {name} must be a finite number ≥ 0, got {value!r}")
    cost = cost or CostModel.load()
    for step in steps:
        check_sizes(step, ep_size, dp_size, token_cap)
    t0 = time.perf_counter()
    places = place([x for step in steps for x in step], ep_size, current, tolerance)
    plans = [_plan_step(step, places, ep_size, dp_size, token_cap, cost, anneal_cfg) for step in steps]
    counts = np.concatenate([slot_counts(p, step, ep_size) for p, step in zip(plans, steps)])
    per_row = (lambda s: s / cost.e) if cost.e > 0 else (lambda s: 0.0)
    refined = pl.refine(places, counts, current, per_row(move_s), layer_rows=per_row(move_layer_s))
    if current is not None:           # relabelling leaves every slot's peak as it is
        refined = [pl.relabel(q, current[l]) for l, q in enumerate(refined)]
    if any(a.rank_of != b.rank_of for a, b in zip(refined, places)):
        again = [_plan_step(step, refined, ep_size, dp_size, token_cap, cost, anneal_cfg, warm=p)
                 for step, p in zip(steps, plans)]
        if window_cost(again, current, move_s, move_layer_s) < window_cost(plans, current, move_s, move_layer_s):
            plans = again
    total = time.perf_counter() - t0
    for p in plans:                   # the window's planner time, shared by its steps
        p.stats.update(planner_s=total / len(steps), window_planner_s=total)
    return plans


def step_lower_bound(samples: list[Sample], ep_size: int, dp_size: int, token_cap: int,
                     cost: CostModel | None = None) -> float:
    """Modeled seconds that no plan of this step can beat (any placement, rows and layout, the
    baselines' included). With A_i the attention proxy, d_l the demand of MoE layer l, G = D / EP
    groups and S ≥ ⌈L1 / D⌉ slots (every cell holds ≤ cap tokens):

        Σ_s cost(s) ≥ S·c0 + max(Σ A / D, max_i A_i) + e · Σ_l LB_l            (G = 1)
        LB_l = max(Σ d_l / EP, the heaviest expert plus the E/EP − 1 lightest)   (placement.lower_bound)

    since Σ_s max_d A(d, s) ≥ each of the two, and Σ_s max_r X_l[s, r] ≥ max_r Σ_s X_l[s, r] with a
    placement fixed over the step. With G > 1 groups the step is the slowest group's, at least
    their mean: S·c0 + Σ A / D + e · Σ_l Σ d_l / (G·EP). The bound adds the attention and expert
    terms' separate minima, which one plan seldom attains together: a plan's ``energy / bound`` is
    at least the factor any better plan could still gain on it, under the model."""
    check_sizes(samples, ep_size, dp_size, token_cap)
    cost = cost or CostModel.load()
    groups = dp_size // ep_size
    attn = cost.attention([s.length for s in samples])
    slots = -(-lower_bound_l1([s.length for s in samples], token_cap) // dp_size)
    d = demand(samples)
    if groups == 1:
        return float(slots * cost.c0 + max(attn.sum() / dp_size, attn.max())
                     + cost.e * sum(pl.lower_bound(layer, ep_size) for layer in d))
    return float(slots * cost.c0 + attn.sum() / dp_size + cost.e * d.sum() / (groups * ep_size))


def evaluate(plan_cells: list[list[list[int]]], placements: list[pl.Placement], samples: list[Sample], ep_size: int,
             cost: CostModel) -> float:
    """Modeled step time of any grid (empty cells allowed: they cost c0 like an idle pass)."""
    D, S = len(plan_cells), max(len(r) for r in plan_cells)
    prob = problem(samples, placements, D, S, ep_size, 10 ** 12, cost)
    cell_of = np.empty(len(samples), dtype=np.int64)
    for dd, row in enumerate(plan_cells):
        for s, members in enumerate(row):
            cell_of[members] = dd * S + s
    return energy(prob, cell_of)
