"""Planning on compact-token work: micro-batches and data-parallel ranks (rows under a token cap:
``arbor.plan.packing.first_fit_decreasing``).

Work of a tree or row = its compact tokens (each shared prefix once; replayed linear-attention
tokens excluded), so ranks receive balanced real work.

- ``assign_lpt(work, num_bins)``: greedy longest-processing-time — items in decreasing work, each
  to the currently lightest bin. Makespan ≤ (4/3 − 1/(3m))·OPT (Graham).
- ``plan_rows(row_tokens, dp_size, token_cap)``: rows to ranks by LPT, then token-capped micro-batches
  on each rank: ``arbor train``'s ``plan.layout=lpt`` (``arbor.train.step_layout``).
"""

from __future__ import annotations

import heapq

from arbor.plan.packing import first_fit_decreasing


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


def plan_rows(row_tokens: list[int], dp_size: int, token_cap: int) -> list[list[list[int]]]:
    """Rows → ranks (greedy LPT over ``dp_size`` by tokens) → each rank's rows into micro-batches of
    ≤ ``token_cap`` tokens (first-fit decreasing; a row above the cap trains alone).

    row_tokens: compact tokens per row. → plan[rank][micro] = row indices. Every row appears once;
    the ranks' token totals differ by at most the largest row (LPT)."""
    plan = []
    for rows in assign_lpt(row_tokens, dp_size):
        bins = first_fit_decreasing([row_tokens[r] for r in rows], token_cap)
        plan.append([[rows[i] for i in b] for b in bins])
    return plan
