"""Expert placement of one MoE layer from its routing demand (EPLB-style balanced packing + swaps).

Input: demand d_e ≥ 0 (routed token copies of expert e over the window), E experts, W EP ranks,
each rank holding exactly L = E / W experts. Load of rank r: ℓ_r = Σ_{e on r} d_e.

1. Balanced packing (DeepSeek EPLB ``balanced_packing``): experts in decreasing demand, each to the
   lightest rank that still has fewer than L experts.
2. Local improvement: while some swap of expert x on the heaviest rank h with expert y on another
   rank o (d_x > d_y) leaves both below ℓ_h, make the one with the smallest max(ℓ_h − δ, ℓ_o + δ),
   δ = d_x − d_y. Each swap lowers the sorted load vector lexicographically, so it ends.
3. Fewer moves when there is a ``current`` placement (every expert that changes rank moves its
   weights and optimizer moments): rank labels of the new placement are permuted to keep as many
   experts as possible where ``current`` has them (ranks are interchangeable); and a second
   candidate runs the swaps of step 2 from ``current`` itself, stopping as soon as its max load is
   within ``tolerance`` (relative) of the new placement's. Of the two, the one with fewer moved
   experts among those within the tolerance is kept, so the result never moves more experts than
   the relabelled placement and its max load is at most (1 + tolerance) × that placement's.
4. ``refine``: once a layout fixes which tokens share each micro-batch slot, swaps that lower the
   cost model's EP term Σ_slot max_r (optionally charging each moved expert) — what a step pays,
   which the aggregate balance of 1-2 only bounds.

Lower bound on max_r ℓ_r for any placement with L experts per rank:
    LB = max(Σ d / W,  d_(1) + Σ of the L − 1 smallest other demands)
(the rank holding the busiest expert holds L − 1 others too). Reported: max ℓ, mean ℓ, max/mean,
max/LB.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

import numpy as np


@dataclass
class Placement:
    rank_of: list[int]       # logical expert → EP rank
    slot_of: list[int]       # logical expert → index among its rank's experts (ascending expert id)
    ep_size: int
    loads: list[float]       # ℓ_r under the demand it was planned for
    lower_bound: float

    @property
    def max_load(self) -> float:
        return max(self.loads)

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.loads) / len(self.loads)
        return self.max_load / mean if mean > 0 else 1.0

    @property
    def max_over_bound(self) -> float:
        return self.max_load / self.lower_bound if self.lower_bound > 0 else 1.0

    def experts_of(self, rank: int) -> list[int]:
        return [e for e in range(len(self.rank_of)) if self.rank_of[e] == rank]


def contiguous(num_experts: int, ep_size: int, demand=None) -> Placement:
    """Static placement: rank r holds experts r·L … r·L + L − 1."""
    _check(num_experts, ep_size)
    L = num_experts // ep_size
    rank_of = [e // L for e in range(num_experts)]
    return _finish(rank_of, ep_size, np.zeros(num_experts) if demand is None else np.asarray(demand, float))


def from_ranks(rank_of: list[int], ep_size: int, demand) -> Placement:
    """The Placement of a given ``rank_of`` (equal experts per rank) and its loads under ``demand``."""
    _check(len(rank_of), ep_size)
    L = len(rank_of) // ep_size
    if sorted(np.bincount(np.asarray(rank_of, dtype=int), minlength=ep_size).tolist()) != [L] * ep_size:
        raise ValueError(f"placement {list(rank_of)} does not hold {L} experts on each of {ep_size} ranks")
    return _finish(list(rank_of), ep_size, np.asarray(demand, dtype=float))


def lower_bound(demand, ep_size: int) -> float:
    d = np.sort(np.asarray(demand, dtype=float))[::-1]
    L = len(d) // ep_size
    return float(max(d.sum() / ep_size, d[0] + np.sort(d[1:])[:L - 1].sum() if len(d) else 0.0))


def balanced(demand, ep_size: int, current: list[int] | None = None, max_swaps: int = 10_000,
             tolerance: float = 0.0) -> Placement:
    """Greedy balanced packing, swap improvement, fewer moves from ``current`` (see module docstring)."""
    d = np.asarray(demand, dtype=float)
    E = len(d)
    _check(E, ep_size)
    L = E // ep_size
    rank_of = np.full(E, -1)
    loads, counts = np.zeros(ep_size), np.zeros(ep_size, dtype=int)
    for e in sorted(range(E), key=lambda e: (-d[e], e)):
        open_ = np.flatnonzero(counts < L)
        r = open_[np.argmin(loads[open_])]
        rank_of[e], loads[r], counts[r] = r, loads[r] + d[e], counts[r] + 1
    rank_of, loads = _swap_improve(rank_of, loads, d, ep_size, max_swaps)
    if current is None:
        return _finish(rank_of.tolist(), ep_size, d)
    current = np.asarray(current)
    if sorted(np.bincount(current, minlength=ep_size).tolist()) != [L] * ep_size or len(current) != E:
        raise ValueError(f"current placement {current.tolist()} does not hold {L} experts on each of {ep_size} ranks")
    fresh = _match_labels(rank_of, current, ep_size)
    target = (1.0 + tolerance) * loads.max()
    kept, kept_loads = _swap_improve(current.copy(), np.bincount(current, d, ep_size), d, ep_size, max_swaps,
                                     stop_at=target)
    moves = lambda r: int((r != current).sum())
    if kept_loads.max() <= target + 1e-9 * max(target, 1.0) and moves(kept) <= moves(fresh):
        return _finish(kept.tolist(), ep_size, d)
    return _finish(fresh.tolist(), ep_size, d)


def _swap_improve(rank_of: np.ndarray, loads: np.ndarray, d: np.ndarray, W: int, max_swaps: int,
                  stop_at: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Step 2: best swaps off the heaviest rank while one lowers its load (or until max ≤ ``stop_at``)."""
    rank_of, loads = rank_of.copy(), np.asarray(loads, dtype=float).copy()
    for _ in range(max_swaps):
        h = int(np.argmax(loads))
        if stop_at is not None and loads[h] <= stop_at + 1e-9 * max(stop_at, 1.0):
            break
        best = None
        xs = np.flatnonzero(rank_of == h)
        for o in range(W):
            if o == h:
                continue
            ys = np.flatnonzero(rank_of == o)
            delta = d[xs][:, None] - d[ys][None, :]             # δ for every (x, y) pair
            new_max = np.maximum(loads[h] - delta, loads[o] + delta)
            new_max[delta <= 0] = np.inf
            k = np.unravel_index(np.argmin(new_max), new_max.shape)
            if new_max[k] < loads[h] - 1e-12 and (best is None or new_max[k] < best[0]):
                best = (new_max[k], xs[k[0]], ys[k[1]], o, delta[k])
        if best is None:
            break
        _, x, y, o, delta = best
        rank_of[x], rank_of[y] = o, h
        loads[h] -= delta
        loads[o] += delta
    return rank_of, loads


def refine(placements: list[Placement], slot_counts: np.ndarray, current: list[list[int]] | None = None,
           move_rows: float = 0.0, max_swaps: int = 1_000, layer_rows: float = 0.0) -> list[Placement]:
    """Local improvement of each MoE layer's placement on the cost model's EP term for a fixed layout.

    ``slot_counts`` [S, Lm, E]: routed copies per expert of each micro-batch slot's tokens (all DP
    ranks of the EP group together), over every step the placements serve. Layer l's term is
    Σ_s max_r Σ_{e on r} X[s, l, e] (each slot waits for its busiest EP rank); the aggregate balance of
    ``balanced`` only bounds it from below. Swaps of two experts on different ranks (equal counts
    kept) are made best first while one lowers the term. With ``current`` (each layer's present
    ``rank_of``) every expert away from its current rank adds ``move_rows`` to the term (a migration's
    seconds per expert in units of the cost model's seconds per routed row) and a layer with any
    expert away adds ``layer_rows`` once (its exchanges), so a swap must pay for what it moves. → new placements (loads: the aggregate demand Σ_s X; the lower bound as
    ``balanced``'s)."""
    X = np.asarray(slot_counts, dtype=float)
    out = []
    for l, p in enumerate(placements):
        W, x = p.ep_size, X[:, l]                                   # [S, E]
        r = np.asarray(p.rank_of)
        cur = None if current is None else np.asarray(current[l])
        onehot = np.eye(W)
        D = x[:, :, None] - x[:, None, :]                           # [S, E, E]: X[s, a] − X[s, b]
        for _ in range(max_swaps):
            loads = x @ onehot[r]                                   # [S, W]
            now = loads.max(1).sum()
            shift = onehot[r][None, :, :] - onehot[r][:, None, :]   # [E, E, W]: row a leaves r[a] for r[b]
            new = (loads[:, None, None, :] + D[..., None] * shift[None]).max(-1).sum(0)   # [E, E]
            if cur is not None and (move_rows or layer_rows):
                away = (r != cur).astype(float)                     # a swap: a goes to r[b], b to r[a]
                after = (away.sum() - away[:, None] - away[None, :]
                         + (r[None, :] != cur[:, None]) + (r[:, None] != cur[None, :]))
                now += move_rows * away.sum() + layer_rows * (away.sum() > 0)
                new += move_rows * after + layer_rows * (after > 0)
            new[r[:, None] == r[None, :]] = np.inf
            a, b = np.unravel_index(np.argmin(new), new.shape)
            if not new[a, b] < now - 1e-9 * max(now, 1.0):
                break
            r[a], r[b] = r[b], r[a]
        out.append(_finish(r.tolist(), W, x.sum(0)))
    return out


def relabel(p: Placement, current: list[int]) -> Placement:
    """``p`` with its rank labels permuted to keep the most experts where ``current`` has them
    (same loads up to the permutation, same peaks)."""
    r = _match_labels(np.asarray(p.rank_of), np.asarray(current), p.ep_size)
    loads = np.zeros(p.ep_size)
    loads[r[np.asarray([p.experts_of(k)[0] for k in range(p.ep_size)])]] = p.loads
    return Placement([int(x) for x in r], _finish(r.tolist(), p.ep_size, np.zeros(len(r))).slot_of, p.ep_size,
                     loads.tolist(), p.lower_bound)


def _match_labels(rank_of: np.ndarray, current: np.ndarray, W: int) -> np.ndarray:
    """Relabel ranks (a permutation) to maximise experts kept on their current rank."""
    overlap = np.zeros((W, W), dtype=int)            # overlap[new label, current rank]
    np.add.at(overlap, (rank_of, current), 1)
    if W <= 7:
        perm = max(permutations(range(W)), key=lambda p: sum(overlap[i, p[i]] for i in range(W)))
    else:                                            # greedy: largest overlaps first
        perm, used_a, used_b = [0] * W, set(), set()
        for flat in np.argsort(-overlap, axis=None, kind="stable"):
            a, b = divmod(int(flat), W)
            if a not in used_a and b not in used_b:
                perm[a] = b
                used_a.add(a)
                used_b.add(b)
    return np.asarray(perm)[rank_of]


def _finish(rank_of: list[int], W: int, d: np.ndarray) -> Placement:
    seen = [0] * W
    slot_of = []
    for r in rank_of:
        slot_of.append(seen[r])
        seen[r] += 1
    loads = np.zeros(W)
    np.add.at(loads, np.asarray(rank_of), d)
    return Placement([int(r) for r in rank_of], slot_of, W, loads.tolist(), lower_bound(d, W))


def _check(E: int, W: int) -> None:
    if W < 1 or E % W:
        raise ValueError(f"ep_size {W} must divide the {E} experts of a layer")


def rank_loads(counts: np.ndarray, rank_of: list[int], ep_size: int) -> np.ndarray:
    """counts [..., E] routed copies per expert → [..., W] per EP rank under ``rank_of``."""
    onehot = np.zeros((len(rank_of), ep_size))
    onehot[np.arange(len(rank_of)), rank_of] = 1.0
    return counts @ onehot
