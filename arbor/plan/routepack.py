"""RoutePack: expert placement, certified row packing and an annealed DP layout for one window.

``routepack(samples, ep_size, dp_size, token_cap) -> Plan``:

1. placement per MoE layer from the window's demand d_l[e] = Σ_i counts_i[l, e]
   (``placement.balanced``; labels matched to ``current`` so fewer experts move);
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
from arbor.plan.packing import Packing, pack_rows


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


def place(samples: list[Sample], ep_size: int, current: list[list[int]] | None = None) -> list[pl.Placement]:
    """Step 1: a balanced placement per MoE layer from the samples' aggregate demand."""
    d = demand(samples)
    return [pl.balanced(d[l], ep_size, None if current is None else current[l]) for l in range(len(d))]


def routepack(samples: list[Sample], ep_size: int, dp_size: int, token_cap: int, cost: CostModel | None = None,
              current: list[list[int]] | None = None, anneal_cfg: AnnealConfig | None = None,
              placements: list[pl.Placement] | None = None) -> Plan:
    """The RoutePack plan of one window (see module docstring). ``current``: each MoE layer's present
    ``rank_of`` (kept where it costs nothing). ``placements``: use these (e.g. one placement for a
    window of several steps, each step packed and laid out on its own) instead of step 1."""
    t0 = time.perf_counter()
    check_sizes(samples, ep_size, dp_size, token_cap)
    cost = cost or CostModel.load()
    places = placements if placements is not None else place(samples, ep_size, current)
    t1 = time.perf_counter()
    packing = pack_rows([s.length for s in samples], token_cap)
    t2 = time.perf_counter()
    slots = -(-len(packing.rows) // dp_size)
    prob = problem(samples, places, dp_size, slots, ep_size, token_cap, cost)
    start = grid_start(packing.rows, prob.lengths, prob.attn, dp_size)
    best, stats = anneal(prob, start, anneal_cfg)
    check_layout(prob, best)
    t3 = time.perf_counter()
    stats.update(placement_s=t1 - t0, packing_s=t2 - t1, layout_s=t3 - t2, planner_s=t3 - t0)
    return Plan("routepack", cells_of(best, dp_size, slots), places, energy(prob, best), packing, stats)


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
