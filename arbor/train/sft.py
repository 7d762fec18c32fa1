"""Supervised fine-tuning on demonstrations: next-token cross-entropy on the loss-masked tokens.

loss = − Σ_t m_t · log π(x_t | x_<t) / Σ_t m_t over each step's batch (token mean), with
batches drawn by a seeded sampler until ``batch_tokens`` tokens, packed into micro-batches of
at most ``tree.token_cap`` tokens (gradient accumulation keeps the token mean exact). MoE models
add ``moe_aux_coef`` × the load-balancing loss of each micro-batch, weighted by its share of the
batch's tokens. ``arbor sft`` checkpoints every ``checkpoint_every`` steps and resumes a stopped run
(``arbor.train.loop.BatchTrainer``).

On several ranks (``arbor launch -n N sft …``) every rank draws the same batch, runs its LPT share of
the micro-batches (``arbor.train.distributed``) and the gradients are summed over ranks, so the
weights equal one process's on the same batches (up to float summation order). With ``dist.fsdp=true``
the model is sharded first (``arbor.train.fsdp``): each rank then holds 1/N of every replicated
parameter, gradient and AdamW moment, and the weights still equal one process's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from arbor.data.config import DataConfig
from arbor.models.lora import LoRAConfig
from arbor.plan.packing import first_fit_decreasing
from arbor.train.logprobs import packed_logprobs
from arbor.distributed import DistConfig, DistContext
from arbor.train.distributed import run_idle_passes, set_recompute
from arbor.train.fsdp import full_hf_tensors, is_fsdp, shard_model
from arbor.train.checkpoint import settings_of
from arbor.train.loop import BatchTrainer
from arbor.train.optim import OptimConfig
from arbor.train.precision import DTYPES, autocast, check_dtype, upcast
from arbor.train.run_log import LogConfig, RunLog
from arbor.train.tree_batch import TreeConfig
from arbor.train.tree_forward import tree_packed_logprobs
from arbor.train.tree_plan import assign_lpt


@dataclass
class SFTConfig:
    steps: int = 200
    batch_tokens: int = 4096
    seed: int = 0
    log_every: int = 20
    checkpoint_every: int = 100    # steps between resumable checkpoints in the run's out/checkpoint (0: none)
    moe_aux_coef: float = 0.0      # MoE: weight of the load-balancing loss (HF Qwen3-MoE uses 0.001)
    recompute: bool = False        # activation recomputation (gradient checkpointing per layer)
    dtype: str = "float32"         # float32 | bfloat16 (autocast; float32 master weights and log-probs) | float16 (CUDA)
    tree: TreeConfig = field(default_factory=lambda: TreeConfig(token_cap=4096))  # micro-batches: prefix trees of ≤ token_cap
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=20))

    def validate(self) -> None:
        from arbor.configs import check
        check(self, (self.steps >= 1, "steps", "must be ≥ 1"), (self.batch_tokens >= 1, "batch_tokens", "must be ≥ 1"),
              (self.log_every >= 1, "log_every", "must be ≥ 1"), (self.checkpoint_every >= 0, "checkpoint_every", "must be ≥ 0"),
              (self.moe_aux_coef >= 0, "moe_aux_coef", "must be ≥ 0"),
              (self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}"))


def draw_batch(rng: random.Random, examples, batch_tokens: int) -> list[int]:
    picked, total = [], 0
    while total < batch_tokens:
        i = rng.randrange(len(examples))
        picked.append(i)
        total += len(examples[i][0])
    return picked


def sft(model, examples: list[tuple[list[int], list[int]]], cfg: SFTConfig, on_log=None, until=None,
        checkpoint_dir=None, settings=None, ctx: DistContext | None = None, run_log=None) -> list[dict]:
    """examples: (ids, loss_mask) pairs. Trains ``model`` in place for ``cfg.steps`` steps, or
    until ``until(step)`` (called after each optimizer step) says stop, resuming from
    ``checkpoint_dir`` when it holds a checkpoint of the same ``settings`` (``arbor.train.loop.BatchTrainer``);
    returns the logged metrics. ``ctx``: the ranks to split each batch over (see module docstring)."""
    if not examples:
        raise ValueError("sft needs at least one demonstration")
    ctx = ctx or DistContext.single()
    check_dtype(cfg.dtype, model.device)
    set_recompute(model, cfg.recompute)
    if ctx.fsdp and not is_fsdp(model):
        shard_model(model, ctx)
    aux_coef = cfg.moe_aux_coef if model.config.moe_layers else 0.0

    def step(rng) -> dict:
        batch = draw_batch(rng, examples, cfg.batch_tokens)
        n_tokens = sum(sum(examples[i][1]) for i in batch)
        all_tokens = sum(len(examples[i][0]) for i in batch)
        loss_sum, aux_sum = 0.0, 0.0
        lengths = [len(examples[i][0]) for i in batch]
        micros = first_fit_decreasing(lengths, cfg.tree.token_cap)
        shares = assign_lpt([sum(lengths[j] for j in m) for m in micros], ctx.world_size)
        mine = [micros[k] for k in sorted(shares[ctx.rank])]
        for micro in mine:
            seqs = [examples[batch[j]][0] for j in micro]
            mask = torch.tensor([m for j in micro for m in examples[batch[j]][1]], dtype=torch.float32,
                                device=model.device)
            with autocast(cfg.dtype, model.device):
                if cfg.tree.enabled:
                    logp, _, *aux = tree_packed_logprobs(model, seqs, cfg=cfg.tree, with_aux=aux_coef > 0)
                else:
                    logp, _, *aux = packed_logprobs(model, seqs, with_aux=aux_coef > 0)
            logp = upcast(logp)
            loss = -(logp * mask).sum() / max(1, n_tokens)
            if aux:
                share = sum(len(s) for s in seqs) / all_tokens
                loss = loss + aux_coef * aux[0] * share
                aux_sum += float(aux[0].detach()) * share
            loss.backward()
            loss_sum += float(loss.detach())
        run_idle_passes(model, max(map(len, shares)) - len(mine))
        loss_sum, aux_sum = ctx.sum_floats([loss_sum, aux_sum]) if ctx.distributed else (loss_sum, aux_sum)
        return {"loss": loss_sum, "tokens": n_tokens, **({"moe_aux": aux_sum} if aux_coef else {})}

    return BatchTrainer(model, cfg, step, settings, ctx).run(on_log, until, checkpoint_dir, run_log)


@dataclass
class SFTRunConfig:
    """``arbor sft``: warm-start a model on conversations (your ``data.train`` rows, or a built-in task's
    demonstrations) and save an HF folder."""
    model: str = "tiny"            # a preset name (random init, built-in tokenizer) or an HF folder
    task: str = "arithmetic"       # a built-in example's demonstrations, used when data.train is empty
    data: DataConfig = field(default_factory=DataConfig)   # data.train=PATH: rows with data.messages_key, or prompt + completion
    tools: list[str] = field(default_factory=list)         # tools rendered into the prompts (as in the RL run that follows)
    out: str = "runs/sft"
    demos: int = 2000              # a built-in task: how many demonstrations
    demo_options: dict = field(default_factory=dict)   # the task's demonstration options, e.g. {mental_rate = 0.6}
    device: str = "cpu"                                # the training device: cpu | cuda | cuda:N
    train: SFTConfig = field(default_factory=SFTConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)   # lora.rank=16: train adapters only; OUT is then a PEFT adapter folder
    dist: DistConfig = field(default_factory=DistConfig)   # multi-rank layout (under `arbor launch`)
    log: LogConfig = field(default_factory=LogConfig)       # OUT/metrics.jsonl, TensorBoard, W&B, progress bar
    memory_check: bool = True      # print the memory plan and stop (exit 2) before step one when it does not fit

    def validate(self) -> None:
        if self.demos < 1:
            raise ValueError(f"demos must be ≥ 1, got {self.demos}")
        if self.dist.fsdp and self.lora.enabled:
            from arbor.train.fsdp import refuse
            raise refuse("with LoRA (lora.rank > 0) only the adapters train, and their optimizer state is small")
        try:
            check_dtype(self.train.dtype, self.device)
        except ValueError as e:
            raise ValueError(f"train.{e}") from None


def sft_examples(cfg: SFTRunConfig, tok) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """The (ids, loss_mask) of every conversation of ``cfg``'s rows (``arbor.data.prompts.conversation``,
    laid out by ``arbor.rollout.chat.ChatLayout``: assistant tokens only are trained), and notes for the
    log: rows that cannot be read, or whose prompt exceeds ``data.max_prompt_tokens``, are dropped and
    counted."""
    from arbor.data.prompts import conversation, keep_rows
    from arbor.data.rewards import RewardConfig
    from arbor.rollout.chat import ChatLayout
    from arbor.tasks.registry import load_task
    d = cfg.data
    task = load_task(task=cfg.task, data=d, reward=RewardConfig(), tools=cfg.tools, env="", seed=cfg.train.seed,
                     n_train=cfg.demos, n_eval=0, row_options=cfg.demo_options, need_reward=False)
    layout = ChatLayout(tok, [t.schema for t in task.tools] or None, d.template_kwargs)

    def example(i, row):
        ids, mask = layout.transcript_ids(conversation(row, d.messages_key, d.prompt_key, d.completion_key,
                                                       task.system, i))
        return (ids, mask), mask.index(1)          # the prompt: the tokens before the first trained one

    examples, _, note = keep_rows(task.train, example, d.max_prompt_tokens, "data.train" if d.train else cfg.task)
    return examples, task.notes + ([note] if note else [])


def run_sft(cfg: SFTRunConfig, on_log=None, until=None):
    """→ (model, tokenizer, history); writes ``cfg.out`` (model + tokenizer, ``metrics.jsonl``), and
    resumes from ``cfg.out/checkpoint`` when an earlier run left one there.
    ``until(model, tokenizer, step) -> bool`` may end training early (see ``sft``). Under ``arbor
    launch`` / torchrun the ranks split each batch (experts over ``dist.ep_size`` ranks for an MoE
    model) and rank 0 writes the one HF folder."""
    import os
    from pathlib import Path

    from arbor.distributed import init_distributed
    from arbor.models import CausalLM, ModelConfig, load_model, save_model
    from arbor.models.checkpoint import gather_hf_tensors
    from arbor.train.lora import adapt, frozen_dtype, save_adapter_folder
    from arbor.models.expert_parallel import shard_experts
    from arbor.models.presets import PRESETS, preset_config
    from arbor.models.tokenizer import Tokenizer, builtin_tokenizer

    from arbor.train.memory_plan import check as check_memory, from_sft
    check_memory(from_sft(cfg), "arbor sft", enforce=cfg.memory_check, show=os.environ.get("RANK", "0") == "0")
    torch.manual_seed(cfg.train.seed)
    if cfg.model in PRESETS:
        tok = builtin_tokenizer()
        mcfg = preset_config(cfg.model, tok)
        ctx = init_distributed(cfg.dist, mcfg.num_experts, cfg.device)
        model = CausalLM(mcfg)
        shard_experts(model, ctx)
    else:
        ctx = init_distributed(cfg.dist, ModelConfig.from_file(cfg.model).num_experts, cfg.device)
        tok = Tokenizer.load(cfg.model)
        model = load_model(cfg.model, dtype=frozen_dtype(cfg.lora, cfg.train.dtype) or torch.float32, ctx=ctx)
    model.to(cfg.device)
    if cfg.lora.enabled:
        adapt(model, cfg.lora, cfg.train.dtype, cfg.model, cfg.out, tok, ctx)
    examples, notes = sft_examples(cfg, tok)
    if ctx.is_main:
        for line in notes:
            print(f"[sft] {line}", flush=True)
    stop = None if until is None else (lambda step: until(model, tok, step))
    run_log = RunLog(cfg.out, cfg, cfg.train.steps, cfg.log, enabled=ctx.is_main, name="sft")
    history = sft(model, examples, cfg.train, on_log, stop, Path(cfg.out) / "checkpoint", settings_of(cfg), ctx, run_log)
    tensors = full_hf_tensors(model, ctx) if ctx.fsdp else \
        gather_hf_tensors(model, ctx) if ctx.ep_size > 1 and not cfg.lora.enabled else None
    if ctx.is_main and cfg.lora.enabled:
        save_adapter_folder(model, cfg.out, tok)
    elif ctx.is_main:
        save_model(model, cfg.out, tokenizer=tok, tensors=tensors)
    ctx.barrier("sft: saved")
    return model, tok, history
