"""``arbor plan calibrate``: measure this machine and fit the planner's cost model (``arbor.plan.cost``).

Two measurements on one process (``threads`` intra-op threads: one per EP rank is what the 2-rank
CPU runs use). Every measured call runs once to warm up, then ``repeats`` rounds run all of them in
turn, and each keeps its fastest time: other processes on a shared machine only ever add time, and
interleaving spreads a burst of their load over all the readings instead of one:

1. one expert, forward + backward of R rows (R = 64 … 1024) → e, the seconds per routed row;
2. the whole model, forward + backward (cross-entropy) of packed batches of 1 … 16 sequences of
   about n tokens each (n = 32 … 2048, alternately n − 1 and n + 1 so that attention takes the
   varlen path real batches take; 512 to 2048 tokens), routing replayed uniformly over the experts so
   that each MoE layer computes k copies of every token → c0, c1, a, b after subtracting
   e·layers·k·Σn.

The fit (non-negative least squares) is written as JSON (``CostModel.save``) with the shape, the
threads and both fits' R² in ``meta``; the planner reads it (``CostModel.load``). The two-rank
measurements (expert migration, the EP step fit) are ``arbor.train.plan_calibrate_ep``.
"""

from __future__ import annotations

import platform
import time
import torch
import torch.nn.functional as F

from arbor.plan.cost import CostModel, fit

BATCHES = [(32, 16), (64, 16), (128, 8), (256, 4), (512, 2), (1024, 1), (128, 4), (512, 1), (2048, 1), (256, 8)]
ROWS = [64, 128, 256, 512, 1024]


def _fastest(fns: list, repeats: int) -> list[float]:
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for j, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - t0)
    return best


def expert_calls(model, rows: list[int]) -> list:
    """Forward + backward of R rows through one expert of the model's shape, per R."""
    from arbor.models.moe import Experts
    D, I = model.config.hidden_size, model.config.moe_intermediate_size
    experts = Experts(1, D, I)
    calls = []
    for R in rows:
        x = torch.randn(R, D, requires_grad=True)

        def run(x=x):
            experts.zero_grad(set_to_none=True)
            experts.grouped([x]).square().mean().backward()
        calls.append(run)
    return calls


def model_calls(model, batches, seed: int = 0) -> list:
    """Forward + backward of the whole model on each packed batch, routing replayed uniformly."""
    from arbor.models import VarlenAttention
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    Lm, k, E = len(cfg.moe_layers), cfg.num_experts_per_tok, cfg.num_experts
    calls = []
    for lengths in batches:
        T = sum(lengths)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
        labels = torch.cat([ids[1:], ids[:1]])
        # uniform routing: token t's j-th copy goes to expert (t·k + j + layer) mod E (k distinct experts)
        base = (torch.arange(T)[:, None] * k + torch.arange(k)[None, :])
        routed = torch.stack([(base + layer) % E for layer in range(Lm)])
        attn = VarlenAttention.from_lengths(lengths)

        def run(ids=ids, labels=labels, routed=routed, attn=attn):
            model.zero_grad(set_to_none=True)
            logits = model.logits(model(ids, attn, routed_experts=routed).hidden)
            F.cross_entropy(logits, labels).backward()
        calls.append(run)
    return calls


def calibrate(model, repeats: int = 3, threads: int = 1, batches=None, rows=None) -> CostModel:
    """Measure (see module docstring) and fit → the cost model (not yet saved)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.train()
        rows = rows or ROWS
        batches = batches or [[n + (1 if i % 2 else -1) if count > 1 else n for i in range(count)]
                              for n, count in BATCHES]
        secs = _fastest(expert_calls(model, rows) + model_calls(model, batches), repeats)
        expert_s = secs[:len(rows)]
        runs = [{"lengths": list(lengths), "seconds": t} for lengths, t in zip(batches, secs[len(rows):])]
    finally:
        torch.set_num_threads(old)
    cfg = model.config
    meta = {"threads": threads, "repeats": repeats, "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "shape": {k: getattr(cfg, k) for k in (
                "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "num_attention_heads", "vocab_size")},
            "expert_rows": rows, "expert_seconds": expert_s, "model_runs": runs}
    return fit(rows, expert_s, runs, len(cfg.moe_layers), cfg.num_experts_per_tok, meta)
