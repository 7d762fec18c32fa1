"""Baselines RoutePack is compared against; both keep the static contiguous expert placement.

- ``token_balance``: samples to DP ranks greedily by token count (largest first to the rank with
  the fewest tokens), then each rank's samples into token-capped micro-batches by first-fit
  decreasing.
- ``karmarkar_karp``: what verl does. Workload w_i = c·n_i + n_i² (c = a / b of the cost model by
  default: the baseline gets the machine's true ratio). Samples to DP ranks by the k-way largest
  differencing method (Karmarkar–Karp) on w; each rank's samples into m micro-batches by KK again,
  m = ⌈Σ n / cap⌉ (the same on every rank: the largest), raised until every micro-batch fits the cap.
  Micro-batches run in decreasing workload.

Either may leave a cell empty when a rank has fewer samples than slots (the trainer then runs an
idle pass there); micro-batch counts are equalised to the largest rank's.
"""

from __future__ import annotations

import heapq

import numpy as np

from arbor.plan import placement as pl
from arbor.plan.cost import CostModel
from arbor.plan.packing import first_fit_decreasing
from arbor.plan.routepack import Plan, Sample, check_sizes, demand, evaluate


def karmarkar_karp(weights, k: int) -> list[list[int]]:
    """k-way largest differencing: → k lists of indices with nearly equal Σ weights."""
    heap = []
    for i, w in enumerate(weights):          # a partial solution: k subsets as (sum, items), sorted by sum
        parts = [(float(w), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), i, parts))
    tie = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=lambda t: -t[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(k)]


def _equalise(ranks: list[list[list[int]]]) -> list[list[list[int]]]:
    S = max(len(r) for r in ranks)
    return [r + [[] for _ in range(S - len(r))] for r in ranks]


def _static(samples: list[Sample], ep_size: int) -> list[pl.Placement]:
    d = demand(samples)
    return [pl.contiguous(d.shape[1], ep_size, d[l]) for l in range(len(d))]


def token_balance(samples: list[Sample], ep_size: int, dp_size: int, token_cap: int,
                  cost: CostModel | None = None) -> Plan:
    check_sizes(samples, ep_size, dp_size, token_cap)
    cost = cost or CostModel.load()
    n = [s.length for s in samples]
    loads, ranks = [0] * dp_size, [[] for _ in range(dp_size)]
    for i in sorted(range(len(n)), key=lambda i: (-n[i], i)):
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += n[i]
    cells = _equalise([[[mine[j] for j in row] for row in first_fit_decreasing([n[i] for i in mine], token_cap)]
                       for mine in ranks])
    places = _static(samples, ep_size)
    return Plan("token balance", cells, places, evaluate(cells, places, samples, ep_size, cost))


def kk_workload(samples: list[Sample], ep_size: int, dp_size: int, token_cap: int, cost: CostModel | None = None,
                c: float | None = None) -> Plan:
    check_sizes(samples, ep_size, dp_size, token_cap)
    cost = cost or CostModel.load()
    c = cost.kk_c if c is None else c
    n = np.array([s.length for s in samples], dtype=float)
    w = c * n + n * n
    ranks = karmarkar_karp(w, dp_size)
    m = max(1, max(-(-int(n[r].sum()) // token_cap) for r in ranks))
    while True:
        parts = [[[r[j] for j in part] for part in karmarkar_karp(w[r], m)] for r in ranks]
        if all(n[p].sum() <= token_cap for rank in parts for p in rank) or m >= len(n):
            break
        m += 1
    cells = [sorted(rank, key=lambda p: -w[p].sum()) for rank in parts]
    places = _static(samples, ep_size)
    return Plan("KK + static", cells, places, evaluate(cells, places, samples, ep_size, cost), stats={"c": c})
