"""Parallelism metrics of diffusion decoding: TPF and AUP (as defined in specs/diffusion.md).

- TPF (tokens per forward) = generated answer tokens (before the stop token) ÷ forward passes,
  over a set of problems: Σ tokens ÷ Σ forwards (each edit-only pass counts as one forward).
- AUP (accuracy under parallelism), from points (ρ_i = TPF, y_i = accuracy in %) sorted by ρ:
  drop points with y_i < y_1 − 5 (y_1 = accuracy at the lowest ρ), then
      AUP = ρ_1·y_1 + Σ_{i≥2} ½(ρ_i − ρ_{i−1})·(y_i·W(y_i) + y_{i−1}·W(y_{i−1})),
      W(y) = min(exp(−3·(1 − y / y_max)), 1),
  y_max = best accuracy of any compared method on the task (default: the best of these points).
  One point at ρ = 1 gives AUP = its accuracy.
"""

from __future__ import annotations

import math


def tpf(num_tokens, forwards) -> float:
    """Σ tokens ÷ Σ forward passes."""
    total = sum(forwards)
    return sum(num_tokens) / total if total else 0.0


def aup_weight(y: float, y_max: float) -> float:
    return min(math.exp(-3.0 * (1.0 - y / y_max)), 1.0) if y_max > 0 else 0.0


def aup(points, y_max: float | None = None) -> float:
    """points: (ρ = TPF, y = accuracy in %) pairs of one model on one task."""
    if not points:
        raise ValueError("AUP needs at least one (TPF, accuracy) point")
    pts = sorted((float(r), float(y)) for r, y in points)
    y1 = pts[0][1]
    pts = [p for p in pts if p[1] >= y1 - 5]
    y_max = max(y for _, y in pts) if y_max is None else y_max
    total = pts[0][0] * pts[0][1]
    for (r0, y0), (r1, y1_) in zip(pts, pts[1:]):
        total += 0.5 * (r1 - r0) * (y1_ * aup_weight(y1_, y_max) + y0 * aup_weight(y0, y_max))
    return total
