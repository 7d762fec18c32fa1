"""Held-out evaluation of an RL run: ``eval.samples`` completions per held-out row.

Metrics (every ``eval_every`` steps, and ``arbor eval``): ``eval_reward`` = the mean episode reward
over all completions; when every reward is 0 or 1 also ``test_accuracy`` = the fraction correct (pass@1
estimated from all k samples) and, with k > 1, ``pass@k`` = the fraction of rows with at least one
correct completion. One sample is decoded greedily; k > 1 sample at ``eval.temperature``. The reward
functions' means over the evaluation are ``eval_reward/<name>`` (kept apart from training's). The
first ``eval.table_rows`` rows' completions form the sample table of the run log.
"""

from __future__ import annotations

import dataclasses

from arbor.rollout.collector import Collector


async def evaluate_rows(trainer, rows: list[dict], samples: int = 1, temperature: float = 1.0,
                        table_rows: int = 0, progress: bool = False) -> tuple[dict, list[dict]]:
    """→ (metrics, table) of ``trainer``'s policy on ``rows`` (module docstring); on several ranks each
    rank rolls out its share and the metrics are summed over ranks (the table is rank 0's)."""
    cfg = dataclasses.replace(trainer.cfg.rollout, temperature=temperature if samples > 1 else 0.0, branch=[samples])
    collector = trainer.collector.for_eval(cfg) if hasattr(trainer.collector, "for_eval") else \
        Collector(trainer.engine, trainer.tok, cfg, trainer.sampling_factory, trainer.cfg.data.template_kwargs)
    ctx = trainer.ctx
    W, r = ctx.world_size, ctx.rank
    mine = rows[r::W]
    from tqdm import tqdm
    bar = tqdm(total=len(mine), desc="eval", disable=not (progress and ctx.is_main))
    pool = []
    async with trainer.engine.session():
        for g, row in enumerate(mine):
            pool += await collector.start(trainer.task.make_env(), row, g, row, 0)
        trees, _, _ = await collector.run_iteration(pool, 0, on_finished=lambda tree: bar.update(1))
    bar.close()
    trees.sort(key=lambda t: t.group)
    rewards = [[t.reward for t in tree.trajectories()] for tree in trees]
    flat = [x for rs in rewards for x in rs]
    binary = float(all(x in (0.0, 1.0) for x in flat))
    sums = [sum(flat), len(flat), sum(any(x == 1.0 for x in rs) for rs in rewards), len(rewards), binary]
    if ctx.distributed:
        sums = ctx.sum_floats(sums[:4] + [1.0 - binary], "eval")
        sums[4] = float(sums[4] == 0)
    total, n, passed, groups, binary = sums
    metrics = {"eval_reward": total / max(1, n)}
    if binary:
        metrics["test_accuracy"] = total / max(1, n)
        if samples > 1:
            metrics[f"pass@{samples}"] = passed / max(1, groups)
    if trainer.task.rewards is not None:       # this evaluation's per-function means, apart from training's
        metrics.update({f"eval_{k}": v for k, v in trainer.task.rewards.drain().items()})
    table = []
    key = trainer.task.prompt_key
    for tree in trees[:table_rows]:
        for t in tree.trajectories()[:1]:
            prompt = tree.task.get(key) if isinstance(tree.task, dict) else None
            if isinstance(prompt, list):       # chat messages: the last one's text
                prompt = next((m.get("content") for m in reversed(prompt) if isinstance(m, dict)), prompt)
            table.append({"prompt": str(prompt if prompt is not None else trainer.tok.decode(t.tokens[:t.prompt_len])),
                          "completion": trainer.tok.decode(t.tokens[t.prompt_len:]), "reward": t.reward})
    return metrics, table
