"""The planner's cost model of one training micro-batch slot, in seconds, fitted on this machine.

A slot s is one micro-batch on every data-parallel rank d of an EP group g (they run in lockstep:
every MoE layer's all-to-all waits for the slowest rank). With cell (d, s) holding samples of
lengths n_i and routing X_l[d, s, r] = token copies that cell sends to EP rank r at MoE layer l:

    cost_g(s) = c0 + max_{d ∈ g} Σ_{i ∈ (d,s)} (c1 + a·n_i + b·n_i²) + e · Σ_l max_r Σ_{d ∈ g} X_l[d, s, r]

- the attention proxy A(n) = c1 + a·n + b·n² holds every per-token cost outside the experts (a:
  projections, norms, head, embeddings), causal attention's quadratic part (b) and a fixed cost per
  sequence (c1: packed varlen attention runs one kernel per sequence);
- the EP peak: per layer, the EP rank with the most routed copies of the slot's tokens from all DP
  ranks of the group sets the pace; e = seconds per routed copy (forward + backward of one row
  through one expert, per layer);
- c0: fixed seconds per micro-batch (launch, Python, the exchanges' latency).

Migrating experts between windows (``arbor.plan.routepack.migration_cost``): ``move_s`` per expert
that changes rank plus ``move_layer_s`` per MoE layer whose placement changes (measured on 2 EP
ranks by ``arbor plan calibrate``; ``move_s`` None when never measured).

A step over S slots then costs max_g Σ_s cost_g(s) (ranks of different EP groups meet only at the
gradient all-reduce). The coefficients are fitted by ``arbor plan calibrate`` from measured step
times (least squares, non-negative) and stored as JSON; ``CostModel.load`` reads it, falling back to
``DEFAULT`` (a fit of the bench ep shape at one thread) when there is none. The
window normalisation the planner needs is implicit: every term is in seconds of the same machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


def default_cost_file() -> Path:
    root = os.environ.get("ARBOR_CACHE") or Path.home() / ".cache" / "arbor"
    return Path(root) / "plan_cost.json"


@dataclass
class CostModel:
    a: float = 2.0e-4        # s per token (everything but experts and the quadratic attention part)
    b: float = 1.0e-7        # s per token² of a causal sequence
    e: float = 1.0e-4        # s per routed token copy on an EP rank, per MoE layer (fwd + bwd)
    c0: float = 5.0e-3       # s per micro-batch
    c1: float = 0.0          # s per sequence
    move_s: float | None = None   # s per migrated expert (weights + AdamW moments); None: not measured
    move_layer_s: float = 0.0     # s per MoE layer whose placement changes (its exchanges), on top
    meta: dict = field(default_factory=dict)   # how and where it was fitted

    def attention(self, lengths) -> np.ndarray:
        n = np.asarray(lengths, dtype=float)
        return self.c1 + self.a * n + self.b * n * n

    @property
    def kk_c(self) -> float:
        """The c of the baseline workload c·len + len² that matches this model (= a / b)."""
        return self.a / self.b if self.b > 0 else 1e9

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path=None) -> "CostModel":
        """From ``path`` (default ``default_cost_file()``); the built-in defaults when it is absent."""
        p = Path(path) if path else default_cost_file()
        if not p.exists():
            if path:
                raise FileNotFoundError(f"no cost model at {p}; write one with `arbor plan calibrate --out {p}`")
            return cls(meta={"source": "built-in defaults"})
        data = json.loads(p.read_text())
        keys = ("a", "b", "e", "c0", "c1", "move_s", "move_layer_s")
        return cls(**{k: data[k] for k in keys if k in data}, meta={**data.get("meta", {}), "file": str(p)})


def nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ‖Xw − y‖ with w ≥ 0 (active-set: drop the most negative coefficient and refit)."""
    X, y = np.asarray(X, float), np.asarray(y, float)
    active = list(range(X.shape[1]))
    w = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            w[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return w


def r_squared(X: np.ndarray, w: np.ndarray, y: np.ndarray) -> float:
    """1 − Σ residual² / Σ (y − ȳ)² of the fit X·w to y."""
    res = y - X @ w
    return float(1 - (res @ res) / max(((y - y.mean()) ** 2).sum(), 1e-30))


def fit(expert_rows: list[int], expert_seconds: list[float], runs: list[dict], moe_layers: int,
        top_k: int, meta: dict | None = None) -> CostModel:
    """Fit the coefficients from measurements.

    ``expert_rows/expert_seconds``: forward+backward of R rows through one expert → e (slope).
    ``runs``: each {"lengths": [...], "seconds": t} a single-process forward+backward of those
    packed sequences (every token's k copies computed locally); t − e·layers·k·Σn is fitted by
    c0 + c1·#sequences + a·Σn + b·Σn² (non-negative least squares). → the model, with R² of both
    fits in ``meta``."""
    R, t = np.asarray(expert_rows, float), np.asarray(expert_seconds, float)
    e_fit = nonneg_lstsq(np.stack([np.ones_like(R), R], 1), t)
    e = float(e_fit[1])
    tokens = np.array([sum(r["lengths"]) for r in runs], float)
    squares = np.array([sum(n * n for n in r["lengths"]) for r in runs], float)
    seqs = np.array([len(r["lengths"]) for r in runs], float)
    secs = np.array([r["seconds"] for r in runs], float)
    y = secs - e * moe_layers * top_k * tokens
    X = np.stack([np.ones_like(tokens), seqs, tokens, squares], 1)
    c0, c1, a, b = nonneg_lstsq(X, y)
    meta = {**(meta or {}), "expert_fit_r2": r_squared(np.stack([np.ones_like(R), R], 1), e_fit, t),
            "step_fit_r2": r_squared(X, np.array([c0, c1, a, b]), y), "runs": len(runs)}
    return CostModel(a=float(a), b=float(b), e=e, c0=float(c0), c1=float(c1), meta=meta)
