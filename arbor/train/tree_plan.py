"""Planning on compact-token work: micro-batches and data-parallel ranks (rows under a token cap:
``arbor.plan.packing.first_fit_decreasing``).

Work of a tree or row = its compact tokens (each shared prefix once; replayed linear-attention
tokens excluded), so ranks receive balanced real work.

- ``assign_lpt(work, num_bins)``: greedy longest-processing-time — items in decreasing work, each
  to the currently lightest bin. Makespan ≤ (4/3 − 1/(3m))·OPT (Graham).
"""

from __future__ import annotations

import heapq


def assign_lpt(work: list[int], num_bins: int) -> list[list[int]]:
    """→ num_bins lists of item indices, balanced by total work (greedy LPT)."""
    if num_bins < 1:
        raise ValueError(f"num_bins must be ≥ 1, got {num_bins}")
    heap = [(0, b) for b in range(num_bins)]
    out: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(work)), key=lambda i: -work[i]):
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + work[i], b))
    return out


def plan_rows(row_tokens: list[int], dp_size: int, micro_per_rank: int | None = None) -> list[list[list[int]]]:
    """Rows → ranks (LPT over dp_size) → micro-batch slots (LPT inside each rank).

    row_tokens: compact tokens per row. micro_per_rank: slots per rank (default: one row per
    slot). → plan[rank][slot] = row indices."""
    ranks = assign_lpt(row_tokens, dp_size)
    plan = []
    for rows in ranks:
        slots = micro_per_rank or max(len(rows), 1)
        inner = assign_lpt([row_tokens[r] for r in rows], slots)
        plan.append([[rows[i] for i in slot] for slot in inner])
    return plan
