"""The config tree of ``arbor train``: ``RLConfig`` and its sections.

``RLConfig.engine`` is the rollout engine's ``EngineConfig`` (``engine.dtype=bfloat16``,
``engine.policy=pd-multiplex``, …), validated by the engine's own ``EngineConfig.validate``. Two of
its keys are not set by hand, because they follow from the rest of the run: ``engine.device`` is
``device`` (the engine is colocated with the trainer, or a replica of it) and
``engine.max_model_len`` is ``rollout.max_context + 64`` (a full context plus room for the turn in
progress). ``engine_config(cfg)`` is the one place that fills them in; ``arbor train``, the Ray
cluster and the benches build their engines from it.

``dllm`` is the section a block-diffusion model reads (EBPO, ``arbor.dllm.ebpo_trainer``); it lives
here, with the rest of the job's config, so that the config tree imports nothing above ``train``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from arbor.configs import check
from arbor.data.config import DataConfig, EvalConfig
from arbor.data.rewards import RewardConfig
from arbor.distributed import DistConfig
from arbor.engine.config import EngineConfig
from arbor.models.lora import LoRAConfig
from arbor.rollout.agent_config import AgentConfig, check_agent_run
from arbor.rollout.collector import RolloutConfig
from arbor.rollout.sandbox import SandboxConfig
from arbor.train.losses import LossConfig
from arbor.train.optim import OptimConfig
from arbor.train.precision import check_dtype
from arbor.train.routepack_hook import PlanConfig
from arbor.train.run_log import LogConfig
from arbor.train.tree_batch import TreeConfig

EBPO_ESTIMATORS = ("ebpo", "ebpo_block", "espo", "mean_field")
DLLM_MODES = ("quality", "speed", "threshold")
CONTEXT_MARGIN = 64      # engine.max_model_len = rollout.max_context + this


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
class EBPOConfig:
    """The ``dllm`` section of ``arbor train``: what changes when the model is a block-diffusion LM."""
    estimator: str = "ebpo"              # ebpo (LLaDA2.1: one ratio per sequence) | ebpo_block | espo | mean_field (d1)
    group_size: int = 8                  # rollouts per prompt (GRPO group)
    levels: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])   # EBPO masking levels t_n
    espo_mc: int = 2                     # espo: mask draws per sample, each with its antithetic complement (2 → 4 forwards)
    prompt_mask_prob: float = 0.15       # mean field: prompt tokens masked w.p. this
    mode: str = "quality"                # rollout decoder: quality | speed | threshold
    temperature: float = 1.0             # rollout sampling temperature (0: greedy, groups identical)
    eval_mode: str = "quality"           # held-out decoding (greedy)

    def validate(self) -> None:
        check(self, (self.estimator in EBPO_ESTIMATORS, "estimator", f"must be one of {EBPO_ESTIMATORS}"),
              (self.group_size >= 2, "group_size", "must be ≥ 2"), (self.espo_mc >= 1, "espo_mc", "must be ≥ 1"),
              (bool(self.levels) and all(0 < t <= 1 for t in self.levels), "levels", "must be a non-empty list in (0, 1]"),
              (0 <= self.prompt_mask_prob < 1, "prompt_mask_prob", "must be in [0, 1)"),
              (self.mode in DLLM_MODES, "mode", f"must be one of {DLLM_MODES}"),
              (self.eval_mode in DLLM_MODES, "eval_mode", f"must be one of {DLLM_MODES}"),
              (self.temperature >= 0, "temperature", "must be ≥ 0"))


# keys of earlier versions → the key that replaced them (``arbor.configs`` names it in the error)
RENAMED_KEYS = {"engine_dtype": "engine.dtype", "engine_share_weights": "engine.share_weights",
                "engine_logit_noise": "engine.logit_noise", "engine_noise_dist": "engine.logit_noise_dist",
                "engine_noise_frac": "engine.logit_noise_frac", "rollout.policy": "engine.policy",
                "rollout.pd_segment_layers": "engine.pd_segment_layers"}
DERIVED_ENGINE_KEYS = {"device": "device", "max_model_len": f"rollout.max_context (+ {CONTEXT_MARGIN})"}


@dataclass
class RLConfig:
    model: str = "runs/demo/sft"
    out: str = "runs/rl"
    task: str = "arithmetic"     # a built-in example (arithmetic, countdown, python, longtail), used when data.train is empty
    data: DataConfig = field(default_factory=DataConfig)       # your rows: data.train=PATH, data.eval=PATH, data.prompt_key, …
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward.fns=["math", "my_rewards.py:fn"], reward.weights, …
    tools: list[str] = field(default_factory=list)   # tool functions offered to the model: ["my_tools.py:search", …]
    env: str = ""                # an environment instead of rows + rewards + tools: "my_env.py:MyEnv"
    agent: AgentConfig = field(default_factory=AgentConfig)   # agent=my_agent.py:run: an OpenAI-client agent (docs/agents.md)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)   # where tool code runs: sandbox.packages, sandbox.files, sandbox.timeout_s, …
    seed: int = 0
    steps: int = 20
    groups_per_step: int = 8
    advantage: str = "grpo"
    normalize_std: bool = True
    ppo_epochs: int = 1          # passes over each step's samples
    mini_batches: int = 1        # optimizer steps per pass (each on 1/mini_batches of the samples)
    device: str = "cpu"          # the trainer's device, and the engine's (engine.device follows it)
    dtype: str = "float32"       # training compute: float32 | bfloat16 (autocast; float32 master weights and log-probs) | float16 (CUDA)
    eval_every: int = 0
    eval_problems: int = 64      # held-out rows evaluated (the first ones of data.eval, or the task's test split)
    eval: EvalConfig = field(default_factory=EvalConfig)   # eval.samples=k (pass@k), eval.temperature, eval.table_rows
    checkpoint_every: int = 5
    resume: bool = True
    replay_routing: bool = True  # MoE: trainer forwards reuse the engine's expert ids per model token (R3)
    moe_aux_coef: float = 0.0    # MoE: weight of the load-balancing loss (tree tokens count multiplicity times)
    recompute: bool = False      # activation recomputation (gradient checkpointing per layer)
    lora: LoRAConfig = field(default_factory=LoRAConfig)   # lora.rank=16: train adapters only (rollouts use them merged)
    old_logprobs: str = "auto"   # auto: θ_old's log-probs from the training forward when exact (see RLTrainer.skips_recompute) | recompute
    engine: EngineConfig = field(default_factory=EngineConfig)   # the rollout engine (engine.dtype, engine.policy, engine.share_weights, …)
    tree: TreeConfig = field(default_factory=TreeConfig)   # each group as one prefix tree (HARTS); token_cap per micro-batch
    rollout: RLRolloutConfig = field(default_factory=RLRolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4, warmup_steps=0, min_lr_ratio=1.0))
    c3po: C3POConfig = field(default_factory=C3POConfig)
    dist: DistConfig = field(default_factory=DistConfig)   # multi-rank layout (under `arbor launch`)
    plan: PlanConfig = field(default_factory=PlanConfig)   # which rank trains which sample: plan.layout, plan.routepack (EP)
    log: LogConfig = field(default_factory=LogConfig)       # OUT/metrics.jsonl, TensorBoard, W&B, progress bar
    dllm: EBPOConfig = field(default_factory=EBPOConfig)   # a block-diffusion model: EBPO (arbor.dllm.ebpo_trainer)
    memory_check: bool = True    # print the memory plan and stop (exit 2) before step one when it does not fit

    RENAMED_KEYS = RENAMED_KEYS

    def __post_init__(self):
        if not isinstance(self.rollout, RLRolloutConfig):      # a plain RolloutConfig: overlap off
            self.rollout = RLRolloutConfig(**vars(self.rollout))

    def validate(self) -> None:
        check_dtype(self.dtype, self.device)
        if self.dist.fsdp and self.lora.enabled:
            from arbor.train.fsdp import refuse
            raise refuse("with LoRA (lora.rank > 0) only the adapters train, and their optimizer state is small")
        if self.plan.routepack and not self.replay_routing:
            raise ValueError("plan.routepack=true plans from the engine's expert ids: it needs replay_routing=true")
        if self.rollout.overlap and self.loss.correction == "none":
            raise ValueError("rollout.overlap=true needs loss.correction tis or icepop (the behaviour policy lags "
                             "the trained one by a version), got loss.correction='none'")
        if self.agent.fn:
            check_agent_run(self)
        for key, source in DERIVED_ENGINE_KEYS.items():
            if getattr(self.engine, key) != getattr(EngineConfig, key):
                raise ValueError(f"engine.{key} is set from {source}; set that instead "
                                 f"(got engine.{key}={getattr(self.engine, key)!r})")
        check(self, (self.steps >= 1, "steps", "must be ≥ 1"), (self.groups_per_step >= 1, "groups_per_step", "must be ≥ 1"),
              (self.advantage in ("grpo", "rloo"), "advantage", "must be grpo or rloo"),
              (self.ppo_epochs >= 1, "ppo_epochs", "must be ≥ 1"), (self.mini_batches >= 1, "mini_batches", "must be ≥ 1"),
              (self.eval_every >= 0, "eval_every", "must be ≥ 0"), (self.eval_problems >= 1, "eval_problems", "must be ≥ 1"),
              (self.checkpoint_every >= 0, "checkpoint_every", "must be ≥ 0"), (self.moe_aux_coef >= 0, "moe_aux_coef", "must be ≥ 0"),
              (self.old_logprobs in ("auto", "recompute"), "old_logprobs", "must be auto or recompute"))


def max_prompt_tokens(cfg: RLConfig) -> int:
    """``data.max_prompt_tokens``, or (0) the context left for one model turn."""
    return cfg.data.max_prompt_tokens or max(1, cfg.rollout.max_context - cfg.rollout.max_turn_tokens)


SHARE_ABOVE_PARAMS = 100_000_000


def engine_shares(cfg: RLConfig, params: int, ranks: int = 1) -> bool:
    """Whether the rollout engine serves the trainer's own tensors (where dtype and device match):
    ``engine.share_weights``, or where it is unset, on an accelerator, on several ranks, and on CPU for
    models above ``SHARE_ABOVE_PARAMS`` parameters. Below it, on one rank, the engine's own copy, packed
    for oneDNN and the few-row kernel (``arbor.engine.cpu_linear``; ~3× the linear weights more memory,
    copied at every sync) rolls out faster: measured 0.35 against 0.45 s per RL step on the e2e bench's
    0.8 M-parameter model (``arbor bench e2e``, AMD EPYC, 2 threads). Several ranks keep sharing: an own
    copy under expert parallelism and RoutePack's expert migration is not measured."""
    if cfg.engine.share_weights is not None:
        return cfg.engine.share_weights
    return not cfg.device.startswith("cpu") or ranks > 1 or params > SHARE_ABOVE_PARAMS


def engine_config(cfg: RLConfig) -> EngineConfig:
    """The engine an RL run rolls out with: ``cfg.engine`` with its derived keys filled in (module
    docstring): device = ``cfg.device``, max_model_len = ``cfg.rollout.max_context + 64``."""
    return dataclasses.replace(cfg.engine, device=cfg.device, max_model_len=cfg.rollout.max_context + CONTEXT_MARGIN)
