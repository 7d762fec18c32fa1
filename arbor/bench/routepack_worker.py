"""One rank of ``arbor bench routepack``'s measured part (started by ``arbor.distributed.launch``; not run by hand).

``python -m arbor.bench.routepack_worker SPEC.json``: the spec names the model shape, the trace
file (``.npz``: every sample's replayed expert ids [Lm, n_i, k]) and, per method and step, the grid of
sample ids (``cells[d][s]``) and each MoE layer's placement. Every rank builds the same model
(``arbor.models.random_init.random_moe_model``: parameters seeded per name and logical expert),
sharded over the 2 EP ranks (DP attention on the same 2 ranks).

A step of a method: migrate the experts (weights and AdamW moments, untimed) to the method's
placement, barrier, then for each slot s this rank's cell (its samples packed, routing replayed from
the trace, random token ids from a per-sample seed) forward + backward (an empty cell runs an idle
pass), then the gradient all-reduce and AdamW (fused, as ``arbor train``). Repeats run interleaved:
for each repeat, each step, each method. Each rank reports its seconds per (method, step, repeat)
and the timed migrations.
Prints ``ROUTEPACK_RESULT <json>``.
"""

from __future__ import annotations

import os

import torch

if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from arbor.models.random_init import random_moe_model  # noqa: E402
from arbor.plan.traces import load_traces  # noqa: E402
from arbor.distributed import DistConfig, init_distributed, shutdown  # noqa: E402
from arbor.models import VarlenAttention  # noqa: E402
from arbor.models.expert_migration import migrate_experts, placements_of  # noqa: E402
from arbor.models.expert_parallel import ExpertPlacement, idle_forward  # noqa: E402
from arbor.train.distributed import reduce_gradients  # noqa: E402
from arbor.train.adamw import AdamW  # noqa: E402

MARK = "ROUTEPACK_RESULT "


def placements(raw: list[dict], ep: int) -> dict[int, ExpertPlacement]:
    return {m: ExpertPlacement(p["rank_of"], p["slot_of"], ep) for m, p in enumerate(raw)}


def run_step(model, opt, ctx, cells: list[list[int]], traces, tokens, global_tokens: int, device) -> None:
    for members in cells:
        if not members:
            idle_forward(model).backward()
            continue
        ids = torch.cat([tokens[i] for i in members]).to(device)
        labels = torch.cat([torch.cat([tokens[i][1:], torch.tensor([-100])]) for i in members]).to(device)
        routed = torch.from_numpy(np.concatenate([traces[i] for i in members], 1)).to(device)
        attn = VarlenAttention.from_lengths([len(tokens[i]) for i in members], device)
        logits = model.logits(model(ids, attn, routed_experts=routed).hidden)
        (F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / global_tokens).backward()
    reduce_gradients(model, ctx)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str]) -> None:
    spec = json.loads(open(argv[0]).read())
    shape = spec["shape"]
    ctx = init_distributed(DistConfig(ep_size=0, timeout_s=spec.get("timeout_s", 120)), shape["num_experts"])
    device = ctx.device
    model = random_moe_model(shape, ctx, device)
    model.train()
    opt = AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)   # as make_optimizer (arbor train)
    traces = load_traces(spec["traces"])
    tokens = [torch.randint(0, shape["vocab_size"], (t.shape[1],), generator=torch.Generator().manual_seed(1000 + i))
              for i, t in enumerate(traces)]
    methods, steps = spec["methods"], spec["steps"]
    seconds = {m: [[] for _ in steps] for m in methods}
    migrations = []
    for rep in range(spec["warmup"] + spec["repeats"]):
        for k, step in enumerate(steps):
            global_tokens = sum(len(tokens[i]) for i in step["samples"])
            for m in methods:
                plan = spec["plans"][m][k]
                target = placements(plan["placements"], ctx.ep_size)
                if any(p.rank_of != placements_of(model)[i].rank_of for i, p in target.items()):
                    ctx.barrier("before migration")
                    t0 = time.perf_counter()
                    info = migrate_experts(model, ctx, target, opt)
                    migrations.append({"to": m, "step": k, "moved": info["moved"],
                                       "seconds": time.perf_counter() - t0, "bytes_sent": info["bytes_sent"]})
                ctx.barrier("step start")
                t0 = time.perf_counter()
                run_step(model, opt, ctx, plan["cells"][ctx.rank], traces, tokens, global_tokens, device)
                if rep >= spec["warmup"]:
                    seconds[m][k].append(time.perf_counter() - t0)
    between = []          # RoutePack's own migrations: one window's placement → the next window's
    starts = spec.get("window_starts", [])
    for k0, k1 in zip(starts, starts[1:]):
        migrate_experts(model, ctx, placements(spec["plans"]["RoutePack"][k0]["placements"], ctx.ep_size), opt)
        ctx.barrier("before migration")
        t0 = time.perf_counter()
        info = migrate_experts(model, ctx, placements(spec["plans"]["RoutePack"][k1]["placements"], ctx.ep_size), opt)
        between.append({"from_step": k0, "to_step": k1, "moved": info["moved"], "bytes_sent": info["bytes_sent"],
                        "seconds": time.perf_counter() - t0})
    ctx.barrier("done")
    print(MARK + json.dumps({"rank": ctx.rank, "seconds": seconds, "migrations": migrations,
                             "window_migrations": between, "threads": torch.get_num_threads()}), flush=True)
    shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1:])
