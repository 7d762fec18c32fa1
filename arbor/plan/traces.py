"""Synthetic routing traces: long-tailed sample lengths and Zipf-skewed expert popularity per layer.

Popularity of expert e at MoE layer l: p_l(e) ∝ 1 / rank_l(e)^s, rank_l a random permutation per
layer (skew varies by layer: s_l drawn uniformly from ``skew``). Each sample has a topic t (one of
``topics``) that tilts the popularity: q_{l,t} = (1 − mix)·p_l + mix·p'_{l,t}, p'_{l,t} another
Zipf over its own permutation, so samples differ in which experts they use. Each token's k experts
are drawn from q without replacement (Gumbel top-k). Lengths: min_len · Pareto(alpha), capped at
max_len (a long tail of long samples).
"""

from __future__ import annotations

import numpy as np


def zipf(num: int, s: float, rng: np.random.Generator) -> np.ndarray:
    p = 1.0 / np.arange(1, num + 1) ** s
    return (p / p.sum())[rng.permutation(num)]


def lengths(n: int, rng: np.random.Generator, min_len: int = 32, max_len: int = 1024, alpha: float = 1.3) -> np.ndarray:
    return np.minimum(max_len, (min_len * (1 + rng.pareto(alpha, n))).astype(np.int64))


def synthetic(n: int, num_experts: int, moe_layers: int, top_k: int, seed: int = 0, skew=(0.8, 1.4),
              topics: int = 4, mix: float = 0.5, min_len: int = 32, max_len: int = 1024, alpha: float = 1.3,
              popularity: list[np.ndarray] | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """→ (ids per sample [Lm, n_i, k] int64, each layer's base popularity). ``popularity``: reuse the
    base popularity of an earlier window (a slowly drifting router), else drawn here."""
    rng = np.random.default_rng(seed)
    if popularity is None:
        popularity = [zipf(num_experts, rng.uniform(*skew), rng) for _ in range(moe_layers)]
    tilt = [[zipf(num_experts, rng.uniform(*skew), rng) for _ in range(topics)] for _ in range(moe_layers)]
    out = []
    for n_i in lengths(n, rng, min_len, max_len, alpha):
        t = rng.integers(topics)
        ids = np.empty((moe_layers, n_i, top_k), dtype=np.int64)
        for l in range(moe_layers):
            q = (1 - mix) * popularity[l] + mix * tilt[l][t]
            g = np.log(q)[None, :] - np.log(-np.log(rng.random((n_i, num_experts))))
            ids[l] = np.argsort(-g, axis=1)[:, :top_k]
        out.append(ids)
    return out, popularity


def save_traces(path, traces: list[np.ndarray]) -> None:
    """Write per-sample expert ids (each [moe_layers, n_i, k]) as one ``.npz``: ids [Lm, Σn, k], offsets [N + 1]."""
    offsets = np.cumsum([0] + [t.shape[1] for t in traces])
    np.savez(path, ids=np.concatenate(traces, 1), offsets=offsets)


def load_traces(path) -> list[np.ndarray]:
    """The per-sample expert ids written by ``save_traces``."""
    data = np.load(path)
    ids, offsets = data["ids"], data["offsets"]          # ids [Lm, Σn, k], offsets [N + 1]
    return [ids[:, offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
