"""The RL loop: collect → advantages → recompute log-probs → train → sync weights, each one call.

Colocated runtime: trainer and engine live in one process. When the engine runs in the trainer's
dtype on the same device and shares (``arbor.train.config.engine_shares``: by default on an
accelerator, on several ranks, and on CPU for models above 100 M parameters) it serves the trainer's parameter tensors,
so a weight sync moves no data; otherwise (a float32 CPU engine then runs its own oneDNN-packed copy)
``engine.update_weights`` copies into the engine's own tensors and repacks them. Either way the sync time is logged every step.

C3PO++ (``c3po.enabled``): each iteration generates until finished groups hold ``token_budget``
model tokens (Φ), keeping at most ``capacity`` groups in flight (Ω); unfinished rollouts carry
over to the next iteration and continue under the new weights; groups older than ``max_age``
iterations (σ) are dropped. A group is trained only once all its samples are done, so group
advantages stay exact. With C3PO++ off, each iteration starts ``groups_per_step`` groups and
waits for all of them (the synchronous baseline).

On several ranks (``arbor launch -n N train …``): each rank runs its own engine (experts split
over the EP group for an MoE model, the engine in lockstep) on its own groups — rank r takes
problems r, r + N, … and the per-rank ``groups_per_step`` / ``token_budget`` — so advantages stay
per group; the step's layout (``arbor.train.step_layout``: ``plan.layout``, ``plan.routepack``) may then
move samples between ranks to balance their work; the policy loss is averaged over the trained tokens
(or samples: ``loss.agg``) of all ranks and gradients are summed over
ranks (``arbor.train.distributed``); metrics are reduced and rank 0 logs them; a checkpoint holds
each rank's state and resumes only at the same world size.

The loop around the steps (resume, logging, evaluation, checkpoints) is ``arbor.train.loop.run_loop``;
the update on a step's trajectories is ``arbor.train.rl_update.PolicyUpdate``.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import random
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from arbor.data.order import epoch_of, row_index
from arbor.distributed import DistContext
from arbor.models.sampling import SamplingSpec
from arbor.train.agent_run import make_collector
from arbor.train.checkpoint import settings_of
from arbor.train.config import RLConfig
from arbor.train.distributed import global_count, set_recompute
from arbor.train.lora import sync_tensors
from arbor.train.loop import run_loop
from arbor.train.optim import make_optimizer
from arbor.train.rl_eval import evaluate_rows
from arbor.train.rl_update import PolicyUpdate, flat
from arbor.train.routepack_hook import RoutePackHook
from arbor.train.step_layout import lay_out
from arbor.train.run_log import RunLog


class RLTrainer(PolicyUpdate):
    def __init__(self, cfg: RLConfig, model, tokenizer, engine, sampling_factory, task, ctx=None):
        self.ctx = ctx or DistContext.single()
        self.overlap = cfg.rollout.overlap
        if self.overlap:
            if self.ctx.distributed:
                raise ValueError("rollout.overlap=true runs on one rank; under `arbor launch` set rollout.overlap=false")
            served = getattr(getattr(engine, "engine", None), "model", None)
            if served is None or served is model:   # the engine keeps serving θ_t while this copy trains to θ_t+1
                model = copy.deepcopy(model)        # (an engine with its own copy needs none)
        self.cfg, self.model, self.tok, self.engine, self.task = cfg, model, tokenizer, engine, task
        self.prefetched = None             # overlap: the next step's (trees, pool, stats), rolled out at θ_t
        self._rollout_thread = ThreadPoolExecutor(1, thread_name_prefix="arbor-rollout") if self.overlap else None
        self.collector = make_collector(cfg, engine, tokenizer, sampling_factory, task, model)   # agent.fn: the agent's
        self.sampling_factory = sampling_factory
        set_recompute(model, cfg.recompute)
        self.reference = None
        if cfg.loss.kl_coef > 0:     # frozen copy of the starting weights (shares the EP groups under EP; whole)
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            self.reference.gradient_checkpointing = False
        if self.ctx.fsdp:            # after the engine and the reference took their whole copies (arbor.train.fsdp)
            shard_trainer_model(model, engine, self.ctx)
        self.optimizer = make_optimizer(model, cfg.optim)
        self.routepack = RoutePackHook(cfg, model, self.optimizer, engine, self.ctx)
        r = cfg.rollout     # the trainer's log-probs are those of the distribution the engine sampled from
        self.spec = SamplingSpec(temperature=r.temperature if r.temperature > 0 else 1.0, top_p=r.top_p)
        self.rows = task.train
        self.step, self.next_problem, self.next_group = 0, 0, 0
        self.pool: list = []
        self.history: list[dict] = []

    # ---- collect ------------------------------------------------------------------------
    def new_group(self):
        """→ (env, row, row, group id): this rank's next row (``arbor.data.order``: seeded epochs);
        group ids are unique over ranks."""
        W, r = self.ctx.world_size, self.ctx.rank
        row = self.rows[row_index(self.next_problem * W + r, len(self.rows), self.cfg.seed, self.cfg.data.shuffle)]
        self.next_problem += 1
        self.next_group += 1
        return self.task.make_env(), row, row, (self.next_group - 1) * W + r

    async def collect(self, iteration: int | None = None):
        """→ (finished trees, episodes carried over, stats) of iteration ``iteration`` (default: this step)."""
        async with self.engine.session():        # collective on a lockstep (expert-parallel) engine
            return await self._collect(self.step if iteration is None else iteration)

    async def _collect(self, iteration: int):
        c = self.cfg.c3po
        if c.enabled:
            return await self.collector.run_iteration(self.pool, iteration, c.token_budget, self.new_group,
                                                      c.capacity, c.max_age)
        pool = []
        for _ in range(self.cfg.groups_per_step):
            env, row, task, g = self.new_group()
            pool += await self.collector.start(env, row, g, task, iteration)
        return await self.collector.run_iteration(pool, iteration)

    def _collect_on_thread(self, iteration: int, threads: int):
        """``collect`` on the rollout thread (an event loop of its own) with ``threads`` torch threads;
        → a future of (collect's result, seconds it took)."""
        def work():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            out = asyncio.run(self.collect(iteration))
            return out, time.perf_counter() - t0
        return self._rollout_thread.submit(work)

    # ---- one step -----------------------------------------------------------------------
    def sync_weights(self) -> float:
        t0 = time.perf_counter()
        self.engine.update_weights(sync_tensors(self.model))
        self.collector.version += 1
        return time.perf_counter() - t0

    def _split_threads(self) -> tuple[int, int]:
        """(rollout, trainer) torch threads while overlapped: ``overlap_threads`` (0: half) and the rest, ≥ 1 each."""
        n = torch.get_num_threads()
        r = self.cfg.rollout.overlap_threads or max(1, n // 2)
        return r, max(1, n - r)

    async def train_step(self) -> dict:
        """collect → learn → sync weights (``rollout.overlap``: see ``_overlapped_step``)."""
        t0 = time.perf_counter()
        if self.overlap:
            return self._overlapped_step(t0)
        trees, self.pool, rstats = await self.collect()
        rollout_s = time.perf_counter() - t0
        return self._finish(self._learn(trees, rstats), rollout_s)

    def _overlapped_step(self, t0: float) -> dict:
        """One-step off-policy: learn on the batch rolled out at θ_t-1 while the rollout thread rolls out
        the next one at θ_t (the engine serves its own copy of the weights, so the optimizer step cannot
        reach it mid-rollout); then wait for that rollout and sync θ_t+1. Staleness is exactly 1 after
        the first step (0 there: its batch is rolled out first, at θ_0). θ_old is the trainer's θ_t
        (the training forward's, or a recompute): the PPO ratio and clip are taken against θ_t and the
        behaviour gap π_θ_t / μ — one version plus engine numerics — is what IcePop / TIS correct,
        token by token (the decoupled objective of AReaL)."""
        threads = torch.get_num_threads()
        if self.prefetched is None:          # the first step of a run: nothing rolled out ahead yet
            self.prefetched = self._collect_on_thread(self.step, threads).result()[0]
        trees, self.pool, rstats = self.prefetched
        self.prefetched = None
        rollout_s = time.perf_counter() - t0
        mine, theirs = self._split_threads()
        ahead = self._collect_on_thread(self.step + 1, mine)
        torch.set_num_threads(theirs)
        try:
            row = self._learn(trees, rstats)
        finally:
            t1 = time.perf_counter()
            wait([ahead])                    # the engine must be idle before its weights move
            torch.set_num_threads(threads)
        self.prefetched, ahead_s = ahead.result()
        row.update(rollout_wait_s=time.perf_counter() - t1, rollout_ahead_s=ahead_s)
        return self._finish(row, rollout_s + row["rollout_wait_s"])

    def _learn(self, trees, rstats) -> dict:
        """Advantages, θ_old (or its skip), the optimizer step(s) on ``trees``; → the step's row (no sync)."""
        t1 = time.perf_counter()
        trajs = [t for tree in trees for t in tree.trajectories()]
        row = {"step": self.step, **rstats}
        total = global_count(len(trajs), self.ctx, "sum", "samples")
        if self.ctx.distributed:
            names = sorted(rstats)
            row.update(zip(names, map(int, self.ctx.sum_floats([rstats[k] for k in names], "rollout stats"))))
        if not total:
            return row
        layout = lay_out(self, trajs, self.advantages(trajs))     # may move samples and experts (collective)
        trajs = layout.trajs
        row.update(layout.stats)
        skip = self.skips_recompute
        logp_old, logp_ref, ent = (None, None, [0.0, 0.0]) if skip else self.recompute_old(trajs, layout)
        t2 = time.perf_counter()
        row.update(self.train_on(trajs, logp_old, logp_ref, entropy=ent if skip else None, layout=layout))
        if self.ctx.distributed:
            ent = self.ctx.sum_floats(ent, "entropy")
        row["entropy"] = ent[0] / max(1.0, ent[1])
        row["recompute_skipped"] = float(skip)
        t3 = time.perf_counter()
        oldest = min((v for v in flat(trajs, "versions") if v >= 0), default=self.collector.version)
        staleness = self.collector.version - oldest   # policy versions behind the one trained
        row.update(recompute_s=t2 - t1, train_s=t3 - t2)
        reward_sum = sum(t.reward for t in trajs)
        if self.ctx.distributed:
            staleness = self.ctx.flags_max(staleness, name="staleness")[0]
            reward_sum = self.ctx.sum_floats([reward_sum], "rewards")[0]
        row.update(staleness=int(staleness), reward=reward_sum / total, samples=total,
                   epoch=epoch_of(self.next_problem * self.ctx.world_size, len(self.rows)))
        if self.task.rewards is not None:
            row.update(self.task.rewards.drain())
        return row

    def _finish(self, row: dict, rollout_s: float) -> dict:
        if "samples" in row:
            row["sync_s"] = self.sync_weights()
        row["rollout_s"] = rollout_s     # rollout time the trainer waited for
        self.step += 1
        return row

    # ---- eval ---------------------------------------------------------------------------
    async def evaluate(self, n: int | None = None, split: str = "test", progress: bool = False) -> float:
        """Held-out accuracy (mean reward when rewards are not 0/1) on the first ``n`` (default
        ``eval_problems``) rows of ``split`` (the task's eval rows, or "train"), greedy."""
        metrics, _ = await self.evaluate_rows(n, split, samples=1, progress=progress)
        return metrics.get("test_accuracy", metrics["eval_reward"])

    async def evaluate_rows(self, n: int | None = None, split: str = "test", samples: int = 1,
                            temperature: float = 1.0, table_rows: int = 0, progress: bool = False):
        rows = (self.task.eval if split == "test" else self.rows)[:n or self.cfg.eval_problems]
        if not rows:
            raise ValueError("no held-out rows: set data.eval=PATH (or eval_every=0)")
        return await evaluate_rows(self, rows, samples, temperature, table_rows, progress)

    # ---- checkpoints (arbor.train.checkpoint) ------------------------------------------
    @property
    def settings(self) -> dict:
        return settings_of(self.cfg)

    def state_dict(self) -> dict:
        return {"pool": self.pool, "next_problem": self.next_problem, "next_group": self.next_group,
                "version": self.collector.version, "python_rng": random.getstate(),
                "prefetched": self.prefetched}

    def load_state_dict(self, s: dict) -> None:
        self.pool, self.next_problem, self.next_group = s["pool"], s["next_problem"], s["next_group"]
        self.collector.version = s["version"]
        self.prefetched = s.get("prefetched")     # overlap: the next step's batch, rolled out before the save
        random.setstate(s["python_rng"])
        self.routepack.relabel_engine()     # the placement came back with the model (load_state)
        fresh = self.task.make_env()
        for ep in self.pool:                # carried episodes: their loaded functions are not in the checkpoint
            if hasattr(ep.env, "bind"):
                ep.env.bind(fresh)
        self.engine.update_weights(sync_tensors(self.model))

    async def eval_row(self) -> dict:
        """The held-out metrics ``run_loop`` adds to a row every ``eval_every`` steps (``arbor.train.rl_eval``);
        the sample completions go to the run log's table."""
        e = self.cfg.eval
        metrics, table = await self.evaluate_rows(samples=e.samples, temperature=e.temperature, table_rows=e.table_rows)
        if table:
            metrics["samples_table"] = table
        return metrics

    async def run(self, on_row=None, stop_after: int | None = None) -> list[dict]:
        """Train to ``cfg.steps`` (``rl_run``)."""
        return await rl_run(self, "rl", on_row, stop_after)


def shard_trainer_model(model, engine, ctx) -> None:
    """``dist.fsdp``: shard the trainer's model over the ranks; its engine must serve a copy of its own."""
    from arbor.train.fsdp import refuse, shard_model
    if getattr(getattr(engine, "engine", None), "model", None) is model:
        raise refuse("the rollout engine serves the trainer's own module; build it with engine.share_weights=false")
    shard_model(model, ctx)


async def rl_run(trainer, name: str, on_row=None, stop_after: int | None = None) -> list[dict]:
    """``run_loop`` of an RL trainer (``RLTrainer``, ``EBPOTrainer``) as ``arbor train`` runs it: resume
    from ``OUT/checkpoint`` (unless ``resume=false``), a ``RunLog`` row per step, ``eval_row`` every
    ``eval_every`` steps, a checkpoint every ``checkpoint_every`` steps. ``stop_after`` ends early after
    that many steps of this call (tests simulate a crash with it)."""
    cfg = trainer.cfg
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    run_log = RunLog(out, cfg, cfg.steps, cfg.log, trainer.ctx.is_main, name)
    steps_run = itertools.count(1)           # ``until`` is asked once after every step of this call
    until = None if stop_after is None else (lambda step: next(steps_run) >= stop_after)
    return await run_loop(trainer, cfg.steps, checkpoint=out / "checkpoint", checkpoint_every=cfg.checkpoint_every,
                          resume=cfg.resume, eval_every=cfg.eval_every, run_log=run_log, on_row=on_row, until=until)
