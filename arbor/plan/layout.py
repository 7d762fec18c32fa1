"""Data-parallel layout: samples into a grid of (DP rank d, micro-batch slot s) cells, and its search.

A layout assigns every sample to one cell c = d·S + s of a D × S grid (S slots on every DP rank:
equal micro-batch counts). Constraints kept by every move: coverage (each sample in exactly one
cell), capacity (Σ lengths of a cell ≤ token cap), no empty cell. DP ranks d form EP groups
g = d // W of W consecutive ranks. Energy (``arbor.plan.cost``): the modeled step time

    E = max_g Σ_s [ c0 + max_{d∈g} A(d,s) + e · Σ_l max_r Σ_{d∈g} X_l(d,s,r) ]

with A(d,s) = Σ_{i∈(d,s)} c1 + a·n_i + b·n_i² and X_l(d,s,r) the routed copies of the cell's tokens to
EP rank r at MoE layer l under the layer's placement.

Search: parallel population annealing, vectorised over a population of P layouts. At inverse
temperatures β_0 < … < β_K (geometric, scaled by the spread of ΔE of random moves at the start),
each member makes ``sweeps`` Metropolis proposals (accept when ΔE ≤ 0 or u < exp(−β·ΔE)) of one of
  - move: one sample to another cell (its cell keeps ≥ 1 sample, the target's room fits it);
  - swap: two samples of different cells (both capacities hold);
  - exchange: the whole contents of two cells of different slots (always feasible);
then the population is resampled to β_{k+1} with weights ∝ exp(−(β_{k+1} − β_k)·E) (systematic
resampling). ΔE is computed from the two touched slots only. The best layout ever seen is returned
and, since the start is a member, it is never worse than the start. Every draw comes from one
``numpy.random.Generator(seed)``: a seed gives one result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AnnealConfig:
    population: int = 16       # P layouts annealed side by side
    levels: int = 8            # temperatures β_0 … β_K
    sweeps: int = 24           # proposals per member per temperature
    beta_lo: float = 0.3       # β_0 = beta_lo / σ(ΔE)
    beta_hi: float = 300.0     # β_K = beta_hi / σ(ΔE)
    seed: int = 0


@dataclass
class Problem:
    """Everything the energy needs: per-sample lengths, attention proxy and EP-rank loads."""
    lengths: np.ndarray        # [N] int
    attn: np.ndarray           # [N] A(n_i), seconds
    loads: np.ndarray          # [N, Lm, W] routed copies of sample i to EP rank r at MoE layer l
    dp_size: int
    slots: int
    ep_size: int
    cap: int
    e: float
    c0: float

    @property
    def cells(self) -> int:
        return self.dp_size * self.slots

    @property
    def groups(self) -> int:
        return self.dp_size // self.ep_size

    def group_cells(self) -> np.ndarray:
        """[G, S, W]: the cells of slot s on the DP ranks of EP group g."""
        G, S, W = self.groups, self.slots, self.ep_size
        d = np.arange(G * W).reshape(G, 1, W)
        return d * S + np.arange(S).reshape(1, S, 1)


def check_layout(p: Problem, cell_of: np.ndarray) -> None:
    """Raise unless ``cell_of`` covers every sample once, respects the cap and leaves no cell empty."""
    cell_of = np.asarray(cell_of)
    if cell_of.shape != p.lengths.shape or cell_of.min(initial=0) < 0 or cell_of.max(initial=0) >= p.cells:
        raise AssertionError("a layout must give every sample one cell of the grid")
    tok = np.bincount(cell_of, p.lengths, p.cells)
    cnt = np.bincount(cell_of, minlength=p.cells)
    if (tok > p.cap).any():
        raise AssertionError(f"cells over the token cap {p.cap}: {np.flatnonzero(tok > p.cap).tolist()}")
    if (cnt == 0).any():
        raise AssertionError(f"empty cells: {np.flatnonzero(cnt == 0).tolist()}")


def cell_sums(p: Problem, cell_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """→ (A per cell [C], X per cell [C, Lm, W])."""
    A = np.bincount(cell_of, p.attn, p.cells)
    X = np.zeros((p.cells,) + p.loads.shape[1:])
    np.add.at(X, cell_of, p.loads)
    return A, X


def slot_costs(p: Problem, A: np.ndarray, X: np.ndarray) -> np.ndarray:
    """A [..., C], X [..., C, Lm, W] → cost per (group, slot) [..., G, S]."""
    gc = p.group_cells()
    Ag, Xg = A[..., gc], X[..., gc, :, :]            # [..., G, S, W] and [..., G, S, W, Lm, W]
    return p.c0 + Ag.max(-1) + p.e * Xg.sum(-3).max(-1).sum(-1)


def energy(p: Problem, cell_of) -> float:
    A, X = cell_sums(p, np.asarray(cell_of))
    return float(slot_costs(p, A, X).sum(-1).max(-1))


class _Population:
    """P layouts and their cached sums; all updates vectorised over the members."""

    def __init__(self, p: Problem, cell_of: np.ndarray, P: int):
        self.p = p
        A, X = cell_sums(p, cell_of)
        self.cell_of = np.tile(cell_of, (P, 1))
        self.tok = np.tile(np.bincount(cell_of, p.lengths, p.cells).astype(np.int64), (P, 1))
        self.cnt = np.tile(np.bincount(cell_of, minlength=p.cells), (P, 1))
        self.A, self.X = np.tile(A, (P, 1)), np.tile(X, (P, 1, 1, 1))
        self.sc = slot_costs(p, self.A, self.X)                 # [P, G, S]
        self.gs = self.sc.sum(-1)
        self.E = self.gs.max(-1)
        S, W = p.slots, p.ep_size
        cells = np.arange(p.cells)
        self.slot_of_cell, self.group_of_cell = cells % S, (cells // S) // W
        self.gc = p.group_cells()

    def take(self, idx: np.ndarray) -> None:
        for k in ("cell_of", "tok", "cnt", "A", "X", "sc", "gs", "E"):
            setattr(self, k, getattr(self, k)[idx])

    def propose(self, kind: int, rng: np.random.Generator):
        """One proposal per member → (feasible, ca, cb, deltas, i, j)."""
        p, P = self.p, self.E.shape[0]
        ar = np.arange(P)
        N, C = len(p.lengths), p.cells
        i, j = rng.integers(N, size=P), rng.integers(N, size=P)
        if kind == 0:                                           # move sample i to cell cb
            ca = self.cell_of[ar, i]
            cb = (ca + 1 + rng.integers(C - 1, size=P)) % C
            n = p.lengths[i]
            ok = (self.cnt[ar, ca] >= 2) & (self.tok[ar, cb] + n <= p.cap)
            dA, dX, dt, dc = -p.attn[i], -p.loads[i], -n, -np.ones(P, dtype=np.int64)
        elif kind == 1:                                         # swap samples i and j
            ca, cb = self.cell_of[ar, i], self.cell_of[ar, j]
            dn = p.lengths[j] - p.lengths[i]
            ok = (ca != cb) & (self.tok[ar, ca] + dn <= p.cap) & (self.tok[ar, cb] - dn <= p.cap)
            dA, dX, dt, dc = p.attn[j] - p.attn[i], p.loads[j] - p.loads[i], dn, np.zeros(P, dtype=np.int64)
        else:                                                   # exchange the contents of cells ca, cb
            ca = rng.integers(C, size=P)
            cb = (ca + 1 + rng.integers(C - 1, size=P)) % C
            ok = (self.slot_of_cell[ca] != self.slot_of_cell[cb]) | (self.group_of_cell[ca] != self.group_of_cell[cb])
            dA, dX = self.A[ar, cb] - self.A[ar, ca], self.X[ar, cb] - self.X[ar, ca]
            dt, dc = self.tok[ar, cb] - self.tok[ar, ca], self.cnt[ar, cb] - self.cnt[ar, ca]
        return ok, ca, cb, (dA, dX, dt, dc), i, j

    def delta_energy(self, ca, cb, dA, dX):
        """New costs of the two touched slots and the new energy, per member."""
        ar = np.arange(len(ca))
        g = (self.group_of_cell[ca], self.group_of_cell[cb])
        s = (self.slot_of_cell[ca], self.slot_of_cell[cb])
        new = []
        for k in range(2):
            cells = self.gc[g[k], s[k]]                         # [P, W]
            ma, mb = (cells == ca[:, None]), (cells == cb[:, None])
            A = self.A[ar[:, None], cells] + ma * dA[:, None] - mb * dA[:, None]
            X = (self.X[ar[:, None], cells] + ma[..., None, None] * dX[:, None] - mb[..., None, None] * dX[:, None])
            new.append(self.p.c0 + A.max(-1) + self.p.e * X.sum(1).max(-1).sum(-1))
        same = (g[0] == g[1]) & (s[0] == s[1])
        gs = self.gs.copy()
        gs[ar, g[0]] += new[0] - self.sc[ar, g[0], s[0]]
        gs[ar, g[1]] += np.where(same, 0.0, new[1] - self.sc[ar, g[1], s[1]])
        return new, gs, gs.max(-1), g, s

    def apply(self, q, kind, ca, cb, deltas, i, j, new, gs, E, g, s) -> None:
        dA, dX, dt, dc = (d[q] for d in deltas)
        a, b = ca[q], cb[q]
        if kind == 0:
            self.cell_of[q, i[q]] = b
        elif kind == 1:
            self.cell_of[q, i[q]], self.cell_of[q, j[q]] = b, a
        else:
            rows = self.cell_of[q]
            self.cell_of[q] = np.where(rows == a[:, None], b[:, None], np.where(rows == b[:, None], a[:, None], rows))
        self.tok[q, a] += dt
        self.tok[q, b] -= dt
        self.cnt[q, a] += dc
        self.cnt[q, b] -= dc
        self.A[q, a] += dA
        self.A[q, b] -= dA
        self.X[q, a] += dX
        self.X[q, b] -= dX
        self.sc[q, g[1][q], s[1][q]] = new[1][q]
        self.sc[q, g[0][q], s[0][q]] = new[0][q]
        self.gs[q], self.E[q] = gs[q], E[q]


def anneal(p: Problem, start: np.ndarray, cfg: AnnealConfig | None = None) -> tuple[np.ndarray, dict]:
    """Population annealing from the layout ``start`` (see module docstring) → (best layout, stats)."""
    cfg = cfg or AnnealConfig()
    start = np.asarray(start, dtype=np.int64)
    check_layout(p, start)
    e0 = energy(p, start)
    stats = {"start_energy": e0, "accepted": 0, "proposed": 0}
    if p.cells < 2 or len(p.lengths) < 2 or cfg.levels < 1:
        return start, {**stats, "energy": e0}
    rng = np.random.default_rng(cfg.seed)
    pop = _Population(p, start, cfg.population)
    spread = []
    for kind in range(3):                                       # σ: typical |ΔE| of feasible moves
        ok, ca, cb, deltas, i, j = pop.propose(kind, rng)
        _, _, E, _, _ = pop.delta_energy(ca, cb, deltas[0], deltas[1])
        spread += np.abs(E - pop.E)[ok & (E != pop.E)].tolist()
    sigma = float(np.median(spread)) if spread else 0.0
    if sigma <= 0:
        return start, {**stats, "energy": e0}
    betas = np.geomspace(cfg.beta_lo / sigma, cfg.beta_hi / sigma, cfg.levels)
    best, best_e = start.copy(), e0
    for k, beta in enumerate(betas):
        for sweep in range(cfg.sweeps):
            kind = int(rng.integers(3))
            ok, ca, cb, deltas, i, j = pop.propose(kind, rng)
            new, gs, E, g, s = pop.delta_energy(ca, cb, deltas[0], deltas[1])
            dE = E - pop.E
            u = rng.random(len(E))
            accept = ok & ((dE <= 0) | (u < np.exp(-beta * np.maximum(dE, 0.0))))
            q = np.flatnonzero(accept)
            stats["proposed"] += len(E)
            stats["accepted"] += len(q)
            if len(q):
                pop.apply(q, kind, ca, cb, deltas, i, j, new, gs, E, g, s)
                m = int(np.argmin(pop.E))
                if pop.E[m] < best_e - 1e-12:
                    best_e, best = float(pop.E[m]), pop.cell_of[m].copy()
        if k + 1 < len(betas):                                  # resample ∝ exp(−Δβ·E)
            w = np.exp(-(betas[k + 1] - beta) * (pop.E - pop.E.min()))
            cum = np.cumsum(w / w.sum())
            pos = (rng.random() + np.arange(len(w))) / len(w)
            pop.take(np.minimum(np.searchsorted(cum, pos), len(w) - 1))
    final = energy(p, best)                                      # exact, not the incremental sums
    if final >= e0:
        best, final = start, e0
    check_layout(p, best)
    return best, {**stats, "energy": final, "sigma": sigma}
