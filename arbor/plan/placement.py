"""Expert placement of one MoE layer from its routing demand (EPLB-style balanced packing + swaps).

Input: demand d_e ≥ 0 (routed token copies of expert e over the window), E experts, W EP ranks,
each rank holding exactly L = E / W experts. Load of rank r: ℓ_r = Σ_{e on r} d_e.

1. Balanced packing (DeepSeek EPLB ``balanced_packing``): experts in decreasing demand, each to the
   lightest rank that still has fewer than L experts.
2. Local improvement: while some swap of expert x on the heaviest rank h with expert y on another
   rank o (d_x > d_y) leaves both below ℓ_h, make the one with the smallest max(ℓ_h − δ, ℓ_o + δ),
   δ = d_x − d_y. Each swap lowers the sorted load vector lexicographically, so it ends.
3. Rank labels are permuted to keep as many experts as possible where ``current`` has them (ranks
   are interchangeable; fewer experts then move).

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


def lower_bound(demand, ep_size: int) -> float:
    d = np.sort(np.asarray(demand, dtype=float))[::-1]
    L = len(d) // ep_size
    return float(max(d.sum() / ep_size, d[0] + np.sort(d[1:])[:L - 1].sum() if len(d) else 0.0))


def balanced(demand, ep_size: int, current: list[int] | None = None, max_swaps: int = 10_000) -> Placement:
    """Greedy balanced packing, swap improvement, label matching (see module docstring)."""
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
    for _ in range(max_swaps):
        h = int(np.argmax(loads))
        best = None
        xs = np.flatnonzero(rank_of == h)
        for o in range(ep_size):
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
    if current is not None:
        rank_of = _match_labels(rank_of, np.asarray(current), ep_size)
    return _finish(rank_of.tolist(), ep_size, d)


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
