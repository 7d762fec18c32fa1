"""One rank of ``arbor bench routepack-rl`` (started by ``arbor.distributed.launch``; not run by hand).

``python -m arbor.bench.routepack_rl_worker SPEC.json``: every rank builds one ``RLTrainer`` per method
(``arbor train``'s trainer: the model folder's MoE split over the 2 EP ranks, its own engine), rolls out
``warmup + windows`` steps with the first one's engine at θ_0 (the recorded samples, routing included),
then trains each method on the same recorded steps, interleaved: for each repeat, each step, each
method, ``RLTrainer._learn`` (advantages, the step's layout — sample exchange, planning, RoutePack's
expert migration —, θ_old, the optimizer steps), timed from a barrier to the slowest rank's end.
Prints ``ROUTEPACK_RL_RESULT <json>``.
"""

from __future__ import annotations

import os

import torch

if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

MARK = "ROUTEPACK_RL_RESULT "
KEPT = ("layout_s", "plan_s", "migrate_s", "routepack_moved", "routepack_fallback", "rank_tokens_max_over_mean",
        "ep_peak_before", "ep_peak_after", "recompute_s", "train_s")


def trainer_for(words: list[str], ctx):
    from arbor import configs
    from arbor.models import load_model
    from arbor.models.tokenizer import Tokenizer
    from arbor.train.config import RLConfig, engine_config
    from arbor.train.rl import RLTrainer
    from arbor.train.run import make_engine, rl_task
    cfg = configs.load(RLConfig, None, words)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, dtype=torch.float32, device="cpu", ctx=ctx)
    tok = Tokenizer.load(cfg.model)
    engine, sampling = make_engine(model, tok, engine_config(cfg), ctx)
    return RLTrainer(cfg, model, tok, engine, sampling, rl_task(cfg, tok), ctx)


def main(argv: list[str]) -> None:
    from arbor.distributed import DistConfig, init_distributed, shutdown
    from arbor.models import ModelConfig
    spec = json.loads(open(argv[0]).read())
    ctx = init_distributed(DistConfig(ep_size=0, timeout_s=spec["timeout_s"]),
                           ModelConfig.from_file(spec["model"]).num_experts)
    trainers = {name: trainer_for(spec["common"] + words, ctx) for name, words in spec["methods"].items()}
    first = next(iter(trainers.values()))
    steps = [asyncio.run(first.collect(k)) for k in range(spec["warmup"] + spec["windows"])]
    seconds = {name: [[] for _ in steps] for name in trainers}
    stats = {name: [[] for _ in steps] for name in trainers}
    tokens = []
    for trees, _, _ in steps:
        mine = sum(len(t.tokens) for tree in trees for t in tree.trajectories())
        tokens.append(int(ctx.sum_floats([mine], "tokens")[0]))
    for rep in range(spec["repeats"]):
        for k, (trees, _, rstats) in enumerate(steps):
            for name, trainer in trainers.items():
                trainer.step = k
                ctx.barrier("step start")
                t0 = time.perf_counter()
                row = trainer._learn(trees, rstats)
                mine = time.perf_counter() - t0
                seconds[name][k].append(ctx.flags_max(mine, name="step seconds")[0])
                stats[name][k].append({key: row[key] for key in KEPT if key in row})
    ctx.barrier("done")
    if ctx.is_main:
        print(MARK + json.dumps({"seconds": seconds, "stats": stats, "tokens": tokens, "warmup": spec["warmup"],
                                 "threads": torch.get_num_threads()}), flush=True)
    shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1:])
