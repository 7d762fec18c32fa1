"""The RL loop: collect → advantages → recompute log-probs → train → sync weights, each one call.

Colocated runtime: trainer and engine live in one process. When the engine runs in the trainer's
dtype on the same device it shares the trainer's parameter tensors, so a weight sync moves no
data; otherwise (or with ``engine_share_weights=false``: a float32 CPU engine then runs its own
oneDNN-packed copy) ``engine.update_weights`` copies into the engine's own tensors and repacks
them. Either way the sync time is logged every step.

C3PO++ (``c3po.enabled``): each iteration generates until finished groups hold ``token_budget``
model tokens (Φ), keeping at most ``capacity`` groups in flight (Ω); unfinished rollouts carry
over to the next iteration and continue under the new weights; groups older than ``max_age``
iterations (σ) are dropped. A group is trained only once all its samples are done, so group
advantages stay exact. With C3PO++ off, each iteration starts ``groups_per_step`` groups and
waits for all of them (the synchronous baseline).

On several ranks (``arbor launch -n N train …``): each rank runs its own engine (experts split
over the EP group for an MoE model, the engine in lockstep) on its own groups — rank r takes
problems r, r + N, … and the per-rank ``groups_per_step`` / ``token_budget`` — so advantages stay
per group; the policy loss is averaged over the samples of all ranks and gradients are summed over
ranks (``arbor.train.distributed``); metrics are reduced and rank 0 logs them; a checkpoint holds
each rank's state and resumes only at the same world size.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import random
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from arbor.configs import check
from arbor.distributed import DistConfig, DistContext
from arbor.models.sampling import SamplingSpec
from arbor.rollout.collector import Collector, RolloutConfig
from arbor.train.advantages import group_advantages
from arbor.train.losses import LossConfig, policy_loss
from arbor.train.loop import load_state, save_state, settings_of
from arbor.train.optim import OptimConfig, make_optimizer, optimizer_step
from arbor.train.run_log import LogConfig, RunLog
from arbor.dllm.ebpo import EBPOConfig
from arbor.train.distributed import global_count, run_idle_passes, set_recompute
from arbor.train.tree_plan import first_fit_decreasing
from arbor.train.logprobs import packed_logprobs
from arbor.train.tree_batch import TreeConfig, build_tree
from arbor.train.tree_forward import tree_packed_logprobs
from arbor.train.routepack_hook import PlanConfig, RoutePackHook


NOISE_DISTS = ("normal", "cauchy")


@dataclass
class C3POConfig:
    enabled: bool = True
    token_budget: int = 2000     # Φ: model tokens of finished groups per iteration
    capacity: int = 16           # Ω: groups in flight
    max_age: int = 2             # σ: iterations a group may live

    def validate(self) -> None:
        check(self, (self.token_budget >= 1, "token_budget", "must be ≥ 1"), (self.capacity >= 1, "capacity", "must be ≥ 1"),
              (self.max_age >= 0, "max_age", "must be ≥ 0"))


@dataclass
class RLRolloutConfig(RolloutConfig):
    """The collector's keys plus how an RL run schedules its rollouts against training."""
    overlap: bool = False        # roll out step t+1 while step t trains (one-step off-policy; see RLTrainer)
    overlap_threads: int = 0     # torch threads of the rollout thread while overlapped (0: half, ≥ 1); the trainer gets the rest

    def validate(self) -> None:
        super().validate()
        check(self, (self.overlap_threads >= 0, "overlap_threads", "must be ≥ 0"))


@dataclass
class RLConfig:
    model: str = "runs/demo/sft"
    out: str = "runs/rl"
    task: str = "arithmetic"
    seed: int = 0
    steps: int = 20
    groups_per_step: int = 8
    advantage: str = "grpo"
    normalize_std: bool = True
    ppo_epochs: int = 1          # passes over each step's samples
    mini_batches: int = 1        # optimizer steps per pass (each on 1/mini_batches of the samples)
    engine_dtype: str = "float32"
    engine_share_weights: bool = True    # false: the engine keeps its own copy even in the trainer's dtype (float32 on CPU: oneDNN-packed), refreshed every sync
    engine_logit_noise: float = 0.0      # std (scale) of noise added to the engine's logits (mismatch studies)
    engine_noise_dist: str = "normal"    # normal | cauchy (heavy-tailed)
    engine_noise_frac: float = 1.0       # fraction of sampled positions that get the noise
    device: str = "cpu"
    eval_every: int = 0
    eval_problems: int = 64
    checkpoint_every: int = 5
    resume: bool = True
    replay_routing: bool = True  # MoE: trainer forwards reuse the engine's expert ids per model token (R3)
    moe_aux_coef: float = 0.0    # MoE: weight of the load-balancing loss (tree tokens count multiplicity times)
    recompute: bool = False      # activation recomputation (gradient checkpointing per layer)
    old_logprobs: str = "auto"   # auto: θ_old's log-probs from the training forward when exact (see RLTrainer.skips_recompute) | recompute
    tree: TreeConfig = field(default_factory=TreeConfig)   # each group as one prefix tree (HARTS); token_cap per micro-batch
    rollout: RLRolloutConfig = field(default_factory=RLRolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4, warmup_steps=0, min_lr_ratio=1.0))
    c3po: C3POConfig = field(default_factory=C3POConfig)
    dist: DistConfig = field(default_factory=DistConfig)   # multi-rank layout (under `arbor launch`)
    plan: PlanConfig = field(default_factory=PlanConfig)   # RoutePack: re-place experts every plan.window steps (EP)
    log: LogConfig = field(default_factory=LogConfig)       # OUT/metrics.jsonl, TensorBoard, W&B, progress bar
    dllm: EBPOConfig = field(default_factory=EBPOConfig)   # a block-diffusion model: EBPO (arbor.dllm.ebpo_trainer)

    def __post_init__(self):
        if not isinstance(self.rollout, RLRolloutConfig):      # a plain RolloutConfig: overlap off
            self.rollout = RLRolloutConfig(**vars(self.rollout))

    def validate(self) -> None:
        if self.rollout.overlap and self.loss.correction == "none":
            raise ValueError("rollout.overlap=true needs loss.correction tis or icepop (the behaviour policy lags "
                             "the trained one by a version), got loss.correction='none'")
        check(self, (self.steps >= 1, "steps", "must be ≥ 1"), (self.groups_per_step >= 1, "groups_per_step", "must be ≥ 1"),
              (self.advantage in ("grpo", "rloo"), "advantage", "must be grpo or rloo"),
              (self.ppo_epochs >= 1, "ppo_epochs", "must be ≥ 1"), (self.mini_batches >= 1, "mini_batches", "must be ≥ 1"),
              (self.engine_dtype in ("float32", "bfloat16", "float16"), "engine_dtype", "must be float32, bfloat16 or float16"),
              (isinstance(self.engine_share_weights, bool), "engine_share_weights", "must be true or false"),
              (self.engine_logit_noise >= 0, "engine_logit_noise", "must be ≥ 0"),
              (self.engine_noise_dist in NOISE_DISTS, "engine_noise_dist", f"must be one of {NOISE_DISTS}"),
              (0 <= self.engine_noise_frac <= 1, "engine_noise_frac", "must be in [0, 1]"),
              (self.eval_every >= 0, "eval_every", "must be ≥ 0"), (self.eval_problems >= 1, "eval_problems", "must be ≥ 1"),
              (self.checkpoint_every >= 0, "checkpoint_every", "must be ≥ 0"), (self.moe_aux_coef >= 0, "moe_aux_coef", "must be ≥ 0"),
              (self.old_logprobs in ("auto", "recompute"), "old_logprobs", "must be auto or recompute"))


# token-weighted means over a step's optimizer steps (moe_aux: sample share; entropy: of π_old, recompute pass)
SUMMED_STATS = ("masked_frac", "mismatch_abs", "clip_low", "clip_high", "dual_clip_frac", "approx_kl", "kl_ref", "moe_aux")


def flat(trajs, key) -> list:
    return [x for t in trajs for x in getattr(t, key)]


class RLTrainer:
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
        self.collector = Collector(engine, tokenizer, cfg.rollout, sampling_factory)
        self.sampling_factory = sampling_factory
        set_recompute(model, cfg.recompute)
        self.optimizer = make_optimizer(model, cfg.optim)
        self.routepack = RoutePackHook(cfg.plan, model, self.optimizer, engine, self.ctx)
        r = cfg.rollout     # the trainer's log-probs are those of the distribution the engine sampled from
        self.spec = SamplingSpec(temperature=r.temperature if r.temperature > 0 else 1.0, top_p=r.top_p)
        self.reference = None
        if cfg.loss.kl_coef > 0:     # frozen copy of the starting weights (shares the EP groups under EP)
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            self.reference.gradient_checkpointing = False
        self.problems = task.generate(max(4096, cfg.steps * cfg.c3po.capacity * 2), seed=cfg.seed, split="train")
        self.step, self.next_problem, self.next_group = 0, 0, 0
        self.pool: list = []
        self.history: list[dict] = []

    # ---- collect ------------------------------------------------------------------------
    def new_group(self):
        """→ (env, problem, group id): this rank's next problem; group ids are unique over ranks."""
        W, r = self.ctx.world_size, self.ctx.rank
        p = self.problems[(self.next_problem * W + r) % len(self.problems)]
        self.next_problem += 1
        self.next_group += 1
        return self.task.make_env(p), p, (self.next_group - 1) * W + r

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
            env, p, g = self.new_group()
            pool += await self.collector.start(env, g, p, iteration)
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

    # ---- train --------------------------------------------------------------------------
    def micro_batches(self, trajs) -> list[list[int]]:
        """Trajectory indices per micro-batch, ≤ tree.token_cap tokens each. Tree mode keeps a
        group together and counts its compact tokens (each shared prefix once)."""
        cap = self.cfg.tree.token_cap
        if not self.cfg.tree.enabled:
            return first_fit_decreasing([len(t.tokens) for t in trajs], cap)
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(trajs):
            groups.setdefault(t.group, []).append(i)
        units = list(groups.values())
        sizes = [build_tree([trajs[i].tokens for i in u]).num_tokens for u in units]
        return [[i for b in bin_ for i in units[b]] for bin_ in first_fit_decreasing(sizes, cap)]

    def logprobs(self, trajs, with_aux: bool = False, model=None, entropy: list | None = None):
        """Per-token log-probs of the sampling distribution (``self.spec``), flat in trajectory order
        (tree forward or packed trajectories). With ``replay_routing`` each MoE layer sends a model
        token to the experts the engine chose for it, so a near-tie in top-k cannot route trainer and
        engine differently; tokens the engine did not route (id −1: prompt, environment, a turn's last
        token) route themselves."""
        model = model or self.model
        seqs = [t.tokens for t in trajs]
        routed = None
        if self.cfg.replay_routing and trajs and all(t.routed_experts is not None for t in trajs):
            routed = torch.cat([t.routed_experts for t in trajs], 1).to(model.device)
        kw = dict(routed_experts=routed, with_aux=with_aux, spec=self.spec, entropy=entropy)
        if self.cfg.tree.enabled:
            return tree_packed_logprobs(model, seqs, cfg=self.cfg.tree, **kw)
        return packed_logprobs(model, seqs, **kw)

    def recompute_old(self, trajs):
        """→ (logp_old per trajectory: the trainer's log-probs at θ_old, logp_ref per trajectory or
        None, {entropy sum, tokens} of π_old over the loss tokens); no gradient."""
        old, ref = [None] * len(trajs), [None] * len(trajs) if self.reference is not None else None
        ent = [0.0, 0.0]
        micros = self.micro_batches(trajs)
        with torch.no_grad():
            for micro in micros:
                sub, entropy = [trajs[i] for i in micro], []
                logp, cu = self.logprobs(sub, entropy=entropy)
                mask = torch.tensor(flat(sub, "loss_mask"), dtype=torch.float32, device=logp.device)
                ent[0] += float((entropy[0] * mask).sum())
                ent[1] += float(mask.sum())
                refp = self.logprobs(sub, model=self.reference)[0] if ref is not None else None
                for j, i in enumerate(micro):
                    old[i] = logp[cu[j]:cu[j + 1]]
                    if ref is not None:
                        ref[i] = refp[cu[j]:cu[j + 1]]
            self._idle_passes(len(micros) * (2 if ref is not None else 1))
        return old, ref, ent

    @property
    def skips_recompute(self) -> bool:
        """True when the log-prob pass at θ_old cannot change anything, so it is skipped: one optimizer
        step per RL step (``ppo_epochs = mini_batches = 1``: every micro-batch's training forward runs
        at θ_old, so ``logp.detach()`` *is* logp_old, bit for bit) and no frozen reference to score.
        The mismatch correction (IcePop/TIS) still sees θ_old vs the engine; the entropy of π_old
        comes from the same forward. Logged as ``recompute_skipped``."""
        c = self.cfg
        return c.old_logprobs == "auto" and c.ppo_epochs == 1 and c.mini_batches == 1 and self.reference is None

    def _idle_passes(self, mine: int) -> None:
        """Under expert parallelism every rank runs as many forward(+backward) passes as the busiest."""
        if getattr(self.model, "ep_state", None) is not None:
            run_idle_passes(self.model, global_count(mine, self.ctx) - mine)

    def mini_batches(self, trajs) -> list[list[int]]:
        """``mini_batches`` parts of the step's samples, whole groups each (round-robin over groups
        in order), so every optimizer step sees complete groups."""
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(trajs):
            groups.setdefault(t.group, []).append(i)
        parts: list[list[int]] = [[] for _ in range(self.cfg.mini_batches)]
        for g, members in enumerate(groups.values()):
            parts[g % len(parts)].extend(members)
        return parts

    def train_on(self, trajs, logp_old, logp_ref=None, entropy: list | None = None) -> dict:
        """``ppo_epochs`` passes over the samples, each ``mini_batches`` optimizer steps; advantages
        once per step. The first optimizer step has r ≡ 1; later ones see how far θ moved from θ_old,
        so the clip and the dual clip act. → step metrics (token-weighted over all optimizer steps).
        ``logp_old`` None (only with one optimizer step, ``skips_recompute``): each micro-batch's own
        forward, detached, is θ_old's; ``entropy`` then receives [entropy sum, tokens] of π_old."""
        if logp_old is None and self.cfg.ppo_epochs * self.cfg.mini_batches != 1:
            raise ValueError("logp_old may be None only with one optimizer step per RL step")
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        adv = group_advantages(rewards, torch.tensor([t.group for t in trajs], dtype=torch.long),
                               self.cfg.advantage, self.cfg.normalize_std)
        stats, norms, skipped = {}, [], 0.0
        aux = self.model.config.moe_layers and self.cfg.moe_aux_coef > 0
        self.model.train()
        for _ in range(self.cfg.ppo_epochs):
            for mini in self.mini_batches(trajs):
                self._train_mini(trajs, mini, adv, logp_old, logp_ref, stats, entropy)
                opt = optimizer_step(self.model, self.optimizer, self.step, self.cfg.steps, self.cfg.optim, self.ctx)
                if opt["skipped"]:
                    skipped += 1
                else:
                    norms.append(opt["grad_norm"])
        self.model.eval()
        out = self._reduce_stats(stats, aux)
        nan = float("nan")
        out.update(grad_norm=sum(norms) / len(norms) if norms else nan, grad_norm_max=max(norms, default=nan),
                   lr=opt["lr"], optimizer_steps=len(norms), skipped_steps=skipped)
        return out

    def _train_mini(self, trajs, mini: list[int], adv, logp_old, logp_ref, stats: dict, entropy: list | None = None) -> None:
        """Forward + backward of one mini-batch (its micro-batches); the loss is the mean over the
        mini-batch's samples of all ranks. Accumulates token-weighted loss statistics in ``stats``."""
        dev = self.model.device
        n = global_count(len(mini), self.ctx, "sum", "samples")
        aux_coef = self.cfg.moe_aux_coef if self.model.config.moe_layers else 0.0
        micros = [[mini[i] for i in m] for m in self.micro_batches([trajs[i] for i in mini])]
        pos = {t: p for p, t in enumerate(mini)}          # sample index inside the mini-batch
        for micro in micros:
            sub = [trajs[i] for i in micro]
            ent = [] if entropy is not None else None
            logp, _, *aux = self.logprobs(sub, with_aux=aux_coef > 0, entropy=ent)
            lengths = torch.tensor([len(t.tokens) for t in sub], device=dev)
            mask = torch.tensor(flat(sub, "loss_mask"), device=dev)
            if ent is not None:
                entropy[0] += float((ent[0] * mask).sum())
                entropy[1] += float(mask.sum())
            old = logp.detach() if logp_old is None else torch.cat([logp_old[i] for i in micro]).to(dev)
            loss, st = policy_loss(
                logp, old, torch.tensor(flat(sub, "logp_infer"), device=dev),
                torch.repeat_interleave(adv[micro].to(dev), lengths), mask,
                torch.repeat_interleave(torch.tensor([pos[i] for i in micro], device=dev), lengths),
                max(n, 1), self.cfg.loss,
                logp_ref=torch.cat([logp_ref[i] for i in micro]).to(dev) if logp_ref is not None else None)
            if aux:   # this micro-batch's share of the mini-batch's sample mean
                loss = loss + aux_coef * aux[0] * len(micro) / n
                stats["moe_aux"] = stats.get("moe_aux", 0.0) + float(aux[0].detach()) * len(micro) / n
            loss.backward()
            stats["loss_sum"] = stats.get("loss_sum", 0.0) + float(loss.detach())
            w = st.pop("tokens")
            for k, v in st.items():
                stats[k] = max(stats.get(k, 0.0), v) if k == "max_k" else stats.get(k, 0.0) + v * w
            stats["tokens"] = stats.get("tokens", 0.0) + w
        self._idle_passes(len(micros))

    def _reduce_stats(self, stats: dict, aux: bool) -> dict:
        """Token-weighted sums (and max k) of this rank → the step's values over all ranks."""
        keys = [k for k in SUMMED_STATS if (k != "moe_aux" or aux) and (k != "kl_ref" or self.reference is not None)]
        sums = [stats.get(k, 0.0) for k in keys] + [stats.get("tokens", 0.0)]
        max_k = stats.get("max_k", 0.0)
        sums.append(stats.get("loss_sum", 0.0))
        if self.ctx.distributed:
            sums = self.ctx.sum_floats(sums, "loss stats")
            max_k = self.ctx.flags_max(max_k, name="max k")[0]
        tokens, loss_sum = sums[-2], sums[-1]
        steps = self.cfg.ppo_epochs * self.cfg.mini_batches
        out = {k: v / steps if k == "moe_aux" else v / max(1.0, tokens) for k, v in zip(keys, sums)}
        return {**out, "loss": loss_sum / steps, "max_k": max_k, "tokens": tokens / self.cfg.ppo_epochs}

    def sync_weights(self) -> float:
        t0 = time.perf_counter()
        self.engine.update_weights(self.model.state_dict())
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
        skip = self.skips_recompute
        logp_old, logp_ref, ent = (None, None, [0.0, 0.0]) if skip else self.recompute_old(trajs)
        t2 = time.perf_counter()
        row.update(self.train_on(trajs, logp_old, logp_ref, entropy=ent if skip else None))
        if self.ctx.distributed:
            ent = self.ctx.sum_floats(ent, "entropy")
        row["entropy"] = ent[0] / max(1.0, ent[1])
        row["recompute_skipped"] = float(skip)
        t3 = time.perf_counter()
        oldest = min((v for v in flat(trajs, "versions") if v >= 0), default=self.collector.version)
        staleness = self.collector.version - oldest   # policy versions behind the one trained
        row.update(self.routepack.after_step(trajs, self.step))      # may migrate experts (collective)
        row.update(recompute_s=t2 - t1, train_s=t3 - t2)
        reward_sum = sum(t.reward for t in trajs)
        if self.ctx.distributed:
            staleness = self.ctx.flags_max(staleness, name="staleness")[0]
            reward_sum = self.ctx.sum_floats([reward_sum], "rewards")[0]
        row.update(staleness=int(staleness), reward=reward_sum / total, samples=total)
        return row

    def _finish(self, row: dict, rollout_s: float) -> dict:
        if "samples" in row:
            row["sync_s"] = self.sync_weights()
        row["rollout_s"] = rollout_s     # rollout time the trainer waited for
        self.step += 1
        return row

    # ---- eval ---------------------------------------------------------------------------
    async def evaluate(self, n: int | None = None, split: str = "test", progress: bool = False) -> float:
        probs = self.task.generate(n or self.cfg.eval_problems, seed=self.cfg.seed + 1, split=split)
        cfg = dataclasses.replace(self.cfg.rollout, temperature=0.0, branch=[1])
        collector = Collector(self.engine, self.tok, cfg, self.sampling_factory)
        pool = []
        W, r = self.ctx.world_size, self.ctx.rank
        from tqdm import tqdm
        bar = tqdm(total=len(probs[r::W]), desc="eval", disable=not (progress and self.ctx.is_main))
        async with self.engine.session():       # each rank its share of the problems
            for g, p in enumerate(probs[r::W]):
                pool += await collector.start(self.task.make_env(p), g, p, 0)
            trees, _, _ = await collector.run_iteration(pool, 0, on_finished=lambda tree: bar.update(1))
        bar.close()
        correct = sum(tree.trajectories()[0].reward for tree in trees)
        if self.ctx.distributed:
            correct = self.ctx.sum_floats([correct], "eval")[0]
        return correct / max(1, len(probs))

    # ---- checkpoints --------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        save_state(folder, self.model, self.optimizer, tokenizer=self.tok, state={
            "step": self.step, "pool": self.pool, "next_problem": self.next_problem, "next_group": self.next_group,
            "version": self.collector.version, "history": self.history, "python_rng": random.getstate(),
            "routepack": self.routepack.state_dict(), "prefetched": self.prefetched,
            "settings": settings_of(self.cfg)}, ctx=self.ctx)

    def load(self, folder: Path) -> bool:
        """Resume from ``folder``'s checkpoint; False (nothing changed) when there is none."""
        s = load_state(folder, self.model, self.optimizer, settings_of(self.cfg), self.ctx)
        if s is None:
            return False
        self.step, self.pool, self.history = s["step"], s["pool"], s["history"]
        self.next_problem, self.next_group = s["next_problem"], s["next_group"]
        self.collector.version = s["version"]
        self.prefetched = s.get("prefetched")     # overlap: the next step's batch, rolled out before the save
        random.setstate(s["python_rng"])
        self.routepack.load_state_dict(s.get("routepack"))
        self.engine.update_weights(self.model.state_dict())
        return True

    async def eval_row(self) -> dict:
        """The held-out metrics ``train_loop`` adds to a row every ``eval_every`` steps."""
        return {"test_accuracy": await self.evaluate()}

    async def run(self, on_row=None, stop_after: int | None = None) -> list[dict]:
        """Train to ``cfg.steps`` (``train_loop``)."""
        return await train_loop(self, "rl", on_row, stop_after)


async def train_loop(trainer, name: str, on_row=None, stop_after: int | None = None) -> list[dict]:
    """The RL loop of ``RLTrainer`` and ``EBPOTrainer``: resume from ``out/checkpoint``, then per step
    ``train_step()`` (awaited when it is a coroutine), ``eval_row()`` every ``eval_every`` steps, one
    ``RunLog`` row (``on_row`` on the main rank), a checkpoint every ``checkpoint_every`` steps.
    ``stop_after`` ends early after that many steps of this call (tests simulate a crash with it)."""
    cfg = trainer.cfg
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint"
    if cfg.resume:
        trainer.load(ckpt)
    run_log = RunLog(out, cfg, cfg.steps, cfg.log, trainer.ctx.is_main, name).start(trainer.step)
    done = 0
    while trainer.step < cfg.steps and (stop_after is None or done < stop_after):
        row = trainer.train_step()
        if inspect.isawaitable(row):
            row = await row
        if cfg.eval_every and trainer.step % cfg.eval_every == 0:
            row.update(await trainer.eval_row())
        row = run_log.log(row)
        trainer.history.append(row)
        if on_row and trainer.ctx.is_main:
            on_row(row)
        if cfg.checkpoint_every and trainer.step % cfg.checkpoint_every == 0:
            trainer.save(ckpt)
        done += 1
    run_log.close()
    return trainer.history

