"""Row packing under a token cap, certified by lower bounds (one-dimensional bin packing).

Items are sample lengths s_i (1 ≤ s_i ≤ C, C = token cap); a row is a bin of total ≤ C.

- ``best_fit_decreasing``: items in decreasing size, each into the fullest row it still fits
  (least room left ≥ s_i), else a new row. At most 11/9·OPT + 6/9 rows.
- ``lower_bound_l1`` = ⌈Σ s_i / C⌉.
- ``lower_bound_l2`` (Martello & Toth 1990): for each α ∈ {0} ∪ {s_i ≤ C/2},
      J1 = {i : s_i > C − α},  J2 = {i : C − α ≥ s_i > C/2},  J3 = {i : C/2 ≥ s_i ≥ α},
      L(α) = |J1| + |J2| + max(0, ⌈(Σ_{J3} s_i − (|J2|·C − Σ_{J2} s_i)) / C⌉),
  L2 = max_α L(α) ≥ L1 (α = 0 gives at least L1). Items in J1 ∪ J2 pairwise cannot share a row;
  the J3 items must fill the room the J2 rows leave, or open rows of their own.
- ``min_slack``: MBS' (Gupta & Ho 1999; Fleszar & Hindi 2002): rows one at a time, each the
  largest remaining item plus the subset of the others that leaves the least room (depth-first over
  items in decreasing size, equal sizes tried once, stopping at a perfect fill or a node budget).
- ``pack_rows``: BFD, then, when BFD misses the bound, first-fit decreasing, MBS' and a few
  largest-first re-orderings; the fewest rows found is "certified" (= max(L1, L2): proven
  minimal) or "best known" with its ``gap`` = rows − bound.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass
class Packing:
    rows: list[list[int]]        # item indices per row; every item exactly once; Σ sizes ≤ cap per row
    l1: int
    l2: int
    certified: bool              # len(rows) == max(l1, l2): no packing has fewer rows

    @property
    def bound(self) -> int:
        return max(self.l1, self.l2)

    @property
    def gap(self) -> int:
        return len(self.rows) - self.bound

    @property
    def status(self) -> str:
        return "certified" if self.certified else f"best known (gap {self.gap})"


def _check(sizes: list[int], cap: int) -> None:
    if cap < 1:
        raise ValueError(f"token cap must be ≥ 1, got {cap}")
    bad = [s for s in sizes if s < 1 or s > cap]
    if bad:
        raise ValueError(f"every sample length must be in 1..{cap} (the token cap); got {sorted(bad)[:5]}")


def lower_bound_l1(sizes: list[int], cap: int) -> int:
    return -(-sum(sizes) // cap)


def lower_bound_l2(sizes: list[int], cap: int) -> int:
    """Martello–Toth L2 (see module docstring); O(n log n + n·k) for k distinct small sizes."""
    if not sizes:
        return 0
    s = sorted(sizes)
    total = [0]
    for v in s:
        total.append(total[-1] + v)
    n, best = len(s), 0

    def count_sum(lo_excl: float, hi_incl: float) -> tuple[int, int]:
        """Items with lo_excl < s ≤ hi_incl: (count, sum)."""
        a, b = bisect.bisect_right(s, lo_excl), bisect.bisect_right(s, hi_incl)
        return b - a, total[b] - total[a]

    half = cap / 2
    for alpha in sorted({0} | {v for v in s if v <= half}):
        n1, _ = count_sum(cap - alpha, math.inf)
        n2, sum2 = count_sum(half, cap - alpha)
        a3 = bisect.bisect_left(s, alpha)
        b3 = bisect.bisect_right(s, half)
        sum3 = total[b3] - total[a3] if b3 > a3 else 0
        extra = sum3 - (n2 * cap - sum2)
        best = max(best, n1 + n2 + max(0, -(-extra // cap)))
    return min(best, n)


def best_fit_decreasing(sizes: list[int], cap: int, order: list[int] | None = None) -> list[list[int]]:
    """→ rows of item indices (see module docstring); ``order``: the item order (default: decreasing)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)) if order is None else order
    rooms: list[tuple[int, int]] = []        # sorted (room left, row id)
    rows: list[list[int]] = []
    for i in order:
        k = bisect.bisect_left(rooms, (sizes[i], -1))
        if k < len(rooms):
            room, r = rooms.pop(k)
            rows[r].append(i)
            bisect.insort(rooms, (room - sizes[i], r))
        else:
            rows.append([i])
            bisect.insort(rooms, (cap - sizes[i], len(rows) - 1))
    return rows


def first_fit_decreasing(sizes: list[int], cap: int) -> list[list[int]]:
    """→ rows of item indices: items in decreasing size (ties by index), each into the first row it
    fits, else a new row. Every index appears exactly once; an item above ``cap`` gets a row of its
    own (the trainer's micro-batches: a sample longer than the cap still trains)."""
    rows, rooms = [], []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for r, room in enumerate(rooms):
            if sizes[i] <= room:
                rows[r].append(i)
                rooms[r] -= sizes[i]
                break
        else:
            rows.append([i])
            rooms.append(cap - sizes[i])
    return rows


def min_slack(sizes: list[int], cap: int, budget: int = 2000) -> list[list[int]]:
    """MBS' rows (see module docstring); ``budget``: search nodes per row."""
    left = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    rows = []
    while left:
        first, rest = left[0], left[1:]
        room = cap - sizes[first]
        vals = [sizes[i] for i in rest]
        suffix = [0] * (len(vals) + 1)
        for k in range(len(vals) - 1, -1, -1):
            suffix[k] = suffix[k + 1] + vals[k]
        best, chosen, nodes = (0, []), [], 0

        def dfs(k: int, used: int) -> bool:
            nonlocal best, nodes
            nodes += 1
            if used > best[0]:
                best = (used, list(chosen))
            if used == room or nodes > budget:
                return True
            k0 = k
            while k < len(vals):
                if used + suffix[k] <= best[0]:         # even everything left cannot beat the best
                    return False
                if vals[k] <= room - used and (k == k0 or vals[k] != vals[k - 1]):
                    chosen.append(k)
                    if dfs(k + 1, used + vals[k]):
                        return True
                    chosen.pop()
                k += 1
            return False

        dfs(0, 0)
        take = {rest[k] for k in best[1]}
        rows.append([first] + [rest[k] for k in best[1]])
        left = [i for i in rest if i not in take]
    return rows


def pack_rows(sizes: list[int], cap: int, tries: int = 8) -> Packing:
    """Fewest rows found by BFD (then FFD and ``tries`` re-orderings when BFD misses the bound),
    with its certificate. Deterministic."""
    sizes = [int(v) for v in sizes]
    _check(sizes, cap)
    l1, l2 = lower_bound_l1(sizes, cap), lower_bound_l2(sizes, cap)
    bound = max(l1, l2)
    best = best_fit_decreasing(sizes, cap)
    if len(best) > bound:
        candidates = [first_fit_decreasing(sizes, cap), min_slack(sizes, cap)]
        dec = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        for t in range(1, tries + 1):        # rotate the large items: a different item opens each row
            big = [i for i in dec if 2 * sizes[i] > cap]
            small = [i for i in dec if 2 * sizes[i] <= cap]
            k = t % max(1, len(small))
            candidates.append(best_fit_decreasing(sizes, cap, big + small[k:] + small[:k]))
        for rows in candidates:
            if len(rows) < len(best):
                best = rows
    return Packing(best, l1, l2, len(best) == bound)
