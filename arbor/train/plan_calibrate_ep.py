"""Two-rank measurements for ``arbor plan calibrate`` (this module is also the rank program, run by
``arbor.distributed.launch``); the one-process fit is ``arbor.train.plan_calibrate``.

- ``calibrate_migration``: the seconds per migrated expert (``CostModel.move_s``), measured where
   a migration really runs: 2 EP ranks, the model sharded over them, fused AdamW with its moments filled by one step; then
   ``migrate_experts`` (weights + both AdamW moments over the EP all-to-all) to placements that
   move M experts in one MoE layer or spread over all of them (``migration_points``) and back,
   ``repeats`` rounds interleaved. A reading is the slowest rank's; each point keeps its fastest.
   Fit (non-negative least squares): seconds = c + move_layer_s · layers changed + move_s · M (a
   changed layer costs its collectives whatever it moves: 6 all-to-alls, 2 tensors × 3 states).
- ``calibrate_ep`` (``--ep``): the step coefficients again, where the planner's steps run: 2 EP
   ranks, each micro-batch (``ep_slots``: long, medium, short and mixed cells per rank, skewed
   routing, 4 placements) timed as each rank's busy CPU seconds, fitted per rank by
   c0 + c1·sequences + a·tokens + b·Σ n² + e·routed rows to its experts. They replace the one-process
   a, b, c0, c1, e (kept in ``meta['one_process']``): one process misses what EP adds per token and
   row (the exchanges' copies, the gathers around them).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from arbor.plan.cost import CostModel, nonneg_lstsq, r_squared
from arbor.plan.traces import save_traces

MIGRATION_MARK = "PLAN_MIGRATION "
SLOTS_MARK = "PLAN_EP_SLOTS "


def migration_points(moe_layers: int, num_experts: int) -> list[tuple[int, int]]:
    """(MoE layers changed, experts moved) pairs that separate the two costs of a migration: moves
    within one layer (its per-expert slope) and the same moves spread over every layer."""
    per_layer = num_experts                                     # swaps: at most every expert of a layer
    one = sorted({m for m in (2, 4, per_layer // 2, per_layer) if 2 <= m <= per_layer and m % 2 == 0})
    pts = [(1, m) for m in one]
    if moe_layers > 1:
        spread = [m * moe_layers for m in one if m * moe_layers >= 2 * moe_layers]
        pts += [(moe_layers, m) for m in spread if (moe_layers, m) not in pts]
    return pts


def migration_targets(num_experts: int, moe_layers: int, ep_size: int,
                      points: list[tuple[int, int]]) -> list[list[list[int]]]:
    """Per (layers, M) in ``points``: each MoE layer's ``rank_of`` that moves exactly M experts from
    the contiguous placement, in the first ``layers`` MoE layers (M / layers each, even), by swapping
    expert j of rank r with expert j of rank r + 1 (r even). → [len(points)][moe_layers][num_experts]."""
    L = num_experts // ep_size
    pairs = [(r * L + j, (r + 1) * L + j) for j in range(L) for r in range(0, ep_size - 1, 2)]
    out = []
    for layers, M in points:
        if not (1 <= layers <= moe_layers and M % (2 * layers) == 0 and 0 < M // layers <= 2 * len(pairs)):
            raise ValueError(f"cannot move {M} experts by swaps in {layers} of {moe_layers} MoE layers "
                             f"of {num_experts} experts on {ep_size} ranks")
        rank_of = [[e // L for e in range(num_experts)] for _ in range(moe_layers)]
        for layer in range(layers):
            for a, b in pairs[:M // layers // 2]:
                rank_of[layer][a], rank_of[layer][b] = rank_of[layer][b], rank_of[layer][a]
        out.append(rank_of)
    return out


def _migration_rank(spec_path: str) -> None:
    """One rank of ``calibrate_migration`` (run by ``arbor.distributed.launch``)."""
    from arbor.distributed import DistConfig, init_distributed, shutdown
    from arbor.models.expert_migration import migrate_experts
    from arbor.models.expert_parallel import ExpertPlacement
    spec = json.loads(Path(spec_path).read_text())
    ctx = init_distributed(DistConfig(ep_size=0, timeout_s=spec["timeout_s"]), spec["num_experts"])
    model = _rank_model(spec, ctx)
    from arbor.train.adamw import AdamW
    opt = AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)   # as arbor train
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()                                                  # the moments exist, as in training
    opt.zero_grad(set_to_none=True)
    E, W = spec["num_experts"], ctx.ep_size
    base = {m: ExpertPlacement.contiguous(E, W) for m in range(len(spec["targets"][0]))}
    seconds = [[] for _ in spec["targets"]]
    for rep in range(spec["warmup"] + spec["repeats"]):
        for k, target in enumerate(spec["targets"]):
            for place in (_placements(target, W), base):         # there and back: both move M experts
                ctx.barrier("migration start")
                t0 = time.perf_counter()
                info = migrate_experts(model, ctx, place, opt)
                dt = time.perf_counter() - t0
                if info["moved"] != spec["moved"][k]:
                    raise RuntimeError(f"migration moved {info['moved']} experts, expected {spec['moved'][k]}")
                if rep >= spec["warmup"]:
                    seconds[k].append(dt)
    ctx.barrier("done")
    print(MIGRATION_MARK + json.dumps({"rank": ctx.rank, "seconds": seconds}), flush=True)
    shutdown(ctx)


def _two_rank_moe(shape: dict | None, model_dir: str | None, what: str):
    """The config of the model to measure on 2 EP ranks; refuses one without an even expert count."""
    from arbor.models import ModelConfig
    cfg = ModelConfig.from_file(Path(model_dir)) if model_dir else ModelConfig(**shape)
    if not cfg.moe_layers or cfg.num_experts % 2:
        raise ValueError(f"{what} needs an MoE model with an even number of experts (2 EP ranks)")
    return cfg


def _run_ranks(tmp: Path, spec: dict, mark: str, threads: int, timeout_s: float, what: str) -> list[dict]:
    """Run this module as 2 ranks on ``spec`` (written to ``tmp``) → each rank's last ``mark`` line,
    parsed; a failed launch or a silent rank raises with the ranks' last lines."""
    from arbor.distributed.launch import launch
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    res = launch([sys.executable, "-m", "arbor.train.plan_calibrate_ep", str(path)], 2, threads,
                 timeout_s=timeout_s, echo=None)
    found = [[json.loads(x[len(mark):]) for x in lines if x.startswith(mark)] for lines in res.output]
    if res.returncode or not all(found):
        tails = "\n".join(f"--- rank {r} ---\n" + "\n".join(lines[-20:]) for r, lines in enumerate(res.output))
        raise RuntimeError(f"{what} failed (exit codes {res.codes})\n{tails}")
    return [f[-1] for f in found]


def calibrate_migration(shape: dict | None = None, model_dir: str | None = None, repeats: int = 3,
                        threads: int = 1, timeout_s: float = 300.0) -> dict:
    """Measure migrations on 2 EP ranks (module docstring, 3) for the model of ``shape``
    (``arbor.models.random_init.random_moe_model``'s random weights) or the HF folder ``model_dir``, and fit
    seconds = c + move_layer_s · (MoE layers changed) + move_s · (experts moved) (non-negative least
    squares). → {"move_s", "move_layer_s", "intercept_s", "points", "seconds", "r2", ...}."""
    cfg = _two_rank_moe(shape, model_dir, "migration calibration")
    E, Lm = cfg.num_experts, len(cfg.moe_layers)
    points = migration_points(Lm, E)
    targets = migration_targets(E, Lm, 2, points)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"shape": shape, "model": model_dir, "num_experts": E, "targets": targets,
                "moved": [m for _, m in points], "repeats": repeats, "warmup": 1, "timeout_s": min(120.0, timeout_s)}
        found = _run_ranks(Path(tmp), spec, MIGRATION_MARK, threads, timeout_s, "migration calibration")
    per_rank = [f["seconds"] for f in found]
    secs = np.array([min(max(reads) for reads in zip(*(r[k] for r in per_rank))) for k in range(len(points))])
    X = np.array([[1.0, layers, m] for layers, m in points])
    w = nonneg_lstsq(X, secs)
    r2 = r_squared(X, w, secs)
    return {"move_s": float(w[2]), "move_layer_s": float(w[1]), "intercept_s": float(w[0]),
            "points": [list(p) for p in points], "seconds": secs.tolist(), "r2": r2, "repeats": repeats,
            "threads": threads}


def with_migration(cost: CostModel, migration: dict) -> CostModel:
    """``cost`` with ``move_s`` and ``move_layer_s`` from ``calibrate_migration``'s result (all of it
    kept in ``meta['migration']``)."""
    cost.move_s, cost.move_layer_s = migration["move_s"], migration["move_layer_s"]
    cost.meta = {**cost.meta, "migration": migration}
    return cost


def ep_slots(num_experts: int, moe_layers: int, top_k: int, max_tokens: int = 2048, count: int = 24,
             placements: int = 4, seed: int = 0) -> dict:
    """The slots ``calibrate_ep`` times on 2 EP ranks: ``count`` slots in ``placements`` groups (one
    random balanced placement per group and MoE layer; the first group contiguous), each rank's cell
    one of: one long sequence, a few medium ones, many short ones, or a mix, of 1/8 … all of
    ``max_tokens`` tokens; routing from ``arbor.plan.traces.synthetic`` (Zipf-skewed per layer), so
    that the routed rows per rank vary apart from the tokens. → {"cells": [slot][rank] → sample ids,
    "lengths", "ids": per sample [Lm, n, k], "rank_of": [group][layer][expert], "group_of_slot"}."""
    from arbor.plan.traces import synthetic
    rng = np.random.default_rng(seed)
    lengths, cells = [], []
    for _ in range(count):
        slot = []
        for _ in range(2):
            total = int(max_tokens * rng.choice([0.125, 0.25, 0.5, 0.75, 1.0]))
            kind = rng.integers(4)
            parts = {0: 1, 1: 4, 2: 16, 3: 6}[int(kind)]
            if kind == 3:                                        # one long sequence and short ones
                cut = rng.dirichlet(np.ones(parts) * 0.3)
            else:
                cut = np.full(parts, 1.0 / parts)
            sizes = np.maximum(1, np.floor(cut * total).astype(int))
            sizes[np.argmax(sizes)] -= max(0, int(sizes.sum()) - max(total, parts))   # the 1-token floor's excess
            slot.append(list(range(len(lengths), len(lengths) + len(sizes))))
            lengths += sizes.tolist()
        cells.append(slot)
    ids = []
    for i, n in enumerate(lengths):
        ids.append(synthetic(1, num_experts, moe_layers, top_k, seed=seed * 1000 + i, max_len=n, min_len=n)[0][0])
    L = num_experts // 2
    rank_of = [[[e // L for e in range(num_experts)] for _ in range(moe_layers)]]
    for _ in range(placements - 1):
        rank_of.append([(rng.permutation(num_experts) // L).tolist() for _ in range(moe_layers)])
    group_of_slot = [s * placements // count for s in range(count)]
    return {"cells": cells, "lengths": lengths, "ids": ids, "rank_of": rank_of, "group_of_slot": group_of_slot}


def ep_features(design: dict) -> np.ndarray:
    """Per (slot, rank): [1, sequences, tokens, Σ n², routed rows to the rank's experts over every
    MoE layer (from both ranks' cells)] — the terms of ``arbor.plan.cost`` for one EP rank."""
    rows = []
    for s, slot in enumerate(design["cells"]):
        rank_of = np.asarray(design["rank_of"][design["group_of_slot"][s]])        # [Lm, E]
        members = [i for cell in slot for i in cell]
        for r, cell in enumerate(slot):
            n = np.array([design["lengths"][i] for i in cell], float)
            routed = sum(int((rank_of[l][np.asarray(design["ids"][i][l])] == r).sum())
                         for i in members for l in range(rank_of.shape[0]))
            rows.append([1.0, len(n), n.sum(), (n * n).sum(), float(routed)])
    return np.array(rows)


def calibrate_ep(shape: dict | None = None, model_dir: str | None = None, repeats: int = 3, threads: int = 1,
                 timeout_s: float = 600.0, max_tokens: int = 2048, count: int = 24, seed: int = 0) -> dict:
    """The step coefficients measured where the planner's steps run: 2 EP ranks (attention DP on the
    same ranks), each rank's busy seconds (its process CPU time: the exchanges' copies included,
    waiting for the peer not) per slot of ``ep_slots``, fastest of ``repeats`` interleaved rounds,
    fitted (non-negative least squares) by c0 + c1·sequences + a·tokens + b·Σ n² + e·routed rows
    (``ep_features``). → {"a", "b", "e", "c0", "c1", "r2", "features", "seconds", ...}."""
    cfg = _two_rank_moe(shape, model_dir, "EP calibration")
    E, Lm = cfg.num_experts, len(cfg.moe_layers)
    design = ep_slots(E, Lm, cfg.num_experts_per_tok, max_tokens, count, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        save_traces(Path(tmp) / "ids.npz", design["ids"])
        spec = {"mode": "slots", "shape": shape, "model": model_dir, "num_experts": E, "cells": design["cells"],
                "rank_of": design["rank_of"], "group_of_slot": design["group_of_slot"], "ids": str(Path(tmp) / "ids.npz"),
                "vocab_size": cfg.vocab_size, "repeats": repeats, "warmup": 1, "timeout_s": min(120.0, timeout_s)}
        found = _run_ranks(Path(tmp), spec, SLOTS_MARK, threads, timeout_s, "EP calibration")
    busy = [f["seconds"] for f in found]                          # [rank][slot] → fastest busy seconds
    secs = np.array([busy[r][s] for s in range(len(design["cells"])) for r in range(2)])
    X = ep_features(design)
    w = nonneg_lstsq(X, secs)
    r2 = r_squared(X, w, secs)
    return {"c0": float(w[0]), "c1": float(w[1]), "a": float(w[2]), "b": float(w[3]), "e": float(w[4]),
            "r2": r2, "features": X.tolist(), "seconds": secs.tolist(), "repeats": repeats, "threads": threads,
            "slots": len(design["cells"]), "max_tokens": max_tokens}


def with_ep_fit(cost: CostModel, ep: dict) -> CostModel:
    """``cost`` with its step coefficients from ``calibrate_ep`` (the one-process fit kept in
    ``meta['one_process']``, the EP measurements in ``meta['ep_fit']``)."""
    cost.meta = {**cost.meta, "one_process": {k: getattr(cost, k) for k in ("a", "b", "e", "c0", "c1")}, "ep_fit": ep}
    cost.a, cost.b, cost.e, cost.c0, cost.c1 = ep["a"], ep["b"], ep["e"], ep["c0"], ep["c1"]
    return cost


def _slots_rank(spec: dict) -> None:
    """One rank of ``calibrate_ep``: every slot's forward + backward of this rank's cell, the
    placement of the slot's group applied first (untimed); busy = process CPU seconds."""
    import resource

    from arbor.plan.traces import load_traces
    from arbor.distributed import DistConfig, init_distributed, shutdown
    from arbor.models import VarlenAttention
    from arbor.models.expert_migration import migrate_experts
    ctx = init_distributed(DistConfig(ep_size=0, timeout_s=spec["timeout_s"]), spec["num_experts"])
    model = _rank_model(spec, ctx)
    traces = load_traces(spec["ids"])
    g = torch.Generator().manual_seed(ctx.rank)
    tokens = [torch.randint(0, spec["vocab_size"], (t.shape[1],), generator=g) for t in traces]

    def cpu() -> float:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    best = [float("inf")] * len(spec["cells"])
    group = None
    for rep in range(spec["warmup"] + spec["repeats"]):
        for s, slot in enumerate(spec["cells"]):
            if spec["group_of_slot"][s] != group:
                group = spec["group_of_slot"][s]
                migrate_experts(model, ctx, _placements(spec["rank_of"][group], ctx.ep_size))
            members = slot[ctx.rank]
            ids = torch.cat([tokens[i] for i in members])
            routed = torch.from_numpy(np.concatenate([traces[i] for i in members], 1))
            attn = VarlenAttention.from_lengths([len(tokens[i]) for i in members])
            ctx.barrier("slot start")
            t0 = cpu()
            logits = model.logits(model(ids, attn, routed_experts=routed).hidden)
            F.cross_entropy(logits, torch.roll(ids, -1)).backward()
            dt = cpu() - t0
            model.zero_grad(set_to_none=True)
            if rep >= spec["warmup"]:
                best[s] = min(best[s], dt)
    ctx.barrier("done")
    print(SLOTS_MARK + json.dumps({"rank": ctx.rank, "seconds": best}), flush=True)
    shutdown(ctx)


def _placements(layers: list[list[int]], ep_size: int) -> dict:
    """Each MoE layer's ``rank_of`` → ``ExpertPlacement`` with slots ascending by expert id (as the
    planner's)."""
    from arbor.models.expert_parallel import ExpertPlacement
    out = {}
    for m, rank_of in enumerate(layers):
        seen, slot_of = [0] * ep_size, []
        for r in rank_of:
            slot_of.append(seen[r])
            seen[r] += 1
        out[m] = ExpertPlacement(list(rank_of), slot_of, ep_size)
    return out


def _rank_model(spec: dict, ctx):
    if spec.get("model"):
        from arbor.models import load_model
        return load_model(spec["model"], dtype=torch.float32, device=ctx.device, ctx=ctx).train()
    from arbor.models.random_init import random_moe_model
    return random_moe_model(spec["shape"], ctx, ctx.device).train()


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _spec = json.loads(Path(sys.argv[1]).read_text())
    _slots_rank(_spec) if _spec.get("mode") == "slots" else _migration_rank(sys.argv[1])
