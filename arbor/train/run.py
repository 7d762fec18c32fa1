"""``arbor train`` / ``arbor eval``: build model, engine and trainer from a config and run them.

The engine is colocated with the trainer (same process), built from ``engine_config(cfg)`` (the
``engine`` section with its derived keys). In the trainer's dtype and device, where it shares
(``engine_shares``: ``engine.share_weights``, unset: on an accelerator, on several ranks, or on CPU
above 100 M parameters) it serves the trainer's own module, so weight sync moves nothing; otherwise it holds a
copy that ``update_weights`` refreshes after every optimizer step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import torch

from arbor.train.checkpoint import save_trainer


def sampling_factory(tokenizer, moe: bool):
    """The collector's ``sampling(max_tokens, temperature, top_p, seed, ignore_eos) → SamplingParams``:
    stop at the tokenizer's end-of-sequence token unless ``ignore_eos``; an MoE model's samples carry
    the engine's expert ids (routing replay)."""
    from arbor.engine import SamplingParams
    eos = tokenizer.eos_token_id

    def sampling(max_tokens, temperature, top_p, seed, ignore_eos=False):
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              stop_token_ids=[] if ignore_eos else [eos], ignore_eos=ignore_eos,
                              return_routed_experts=moe)

    return sampling


def make_engine(model, tokenizer, engine_cfg, ctx=None):
    """→ (AsyncLLMEngine serving ``model`` with ``engine_cfg`` — an RL run's is
    ``arbor.train.config.engine_config(cfg)`` —, its ``sampling_factory``)."""
    from arbor.engine import AsyncLLMEngine
    engine = AsyncLLMEngine(model, engine_cfg, tokenizer=tokenizer, ctx=ctx)
    return engine, sampling_factory(tokenizer, bool(model.config.moe_layers))


def rl_task(cfg, tokenizer):
    """The ``Task`` of an RL config (``arbor.tasks.registry.load_task``): its rows, environment,
    rewards and tools; its notes (reward forms, dropped rows) are printed once. The ``sandbox`` section
    becomes the one tool code runs in (the ``python`` tool's, and any ``run_python`` given no config)."""
    from arbor.rollout.sandbox import configure
    from arbor.tasks.registry import load_task
    if cfg.agent.fn:                    # an OpenAI-client agent: its rows, no environment (arbor.train.agent_run)
        from arbor.train.agent_run import agent_task
        return agent_task(cfg)
    configure(cfg.sandbox)
    from arbor.train.config import max_prompt_tokens
    task = load_task(task=cfg.task, data=cfg.data, reward=cfg.reward, tools=cfg.tools, env=cfg.env, seed=cfg.seed,
                     n_train=max(4096, cfg.steps * cfg.c3po.capacity * 2), n_eval=cfg.eval_problems,
                     tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens(cfg), max_turns=cfg.rollout.max_turns,
                     tool_timeout_s=cfg.rollout.tool_timeout_s)
    return task


def print_notes(task, ctx=None) -> None:
    import sys
    if ctx is None or ctx.is_main:
        for line in task.notes:
            print(f"[{task.name}] {line}", file=sys.stderr, flush=True)


def build_trainer(cfg):
    """Model, engine and RL trainer of ``cfg`` (an autoregressive model; ``arbor.families`` picks the trainer
    of other families); under ``arbor launch`` / torchrun each rank builds its own, with the experts of an
    MoE model split over ``dist.ep_size`` ranks."""
    from arbor.distributed import init_distributed
    from arbor.models import ModelConfig, load_model
    from arbor.models.tokenizer import Tokenizer
    from arbor.train.config import engine_config, engine_shares
    from arbor.train.rl import RLTrainer
    torch.manual_seed(cfg.seed)
    ctx = init_distributed(cfg.dist, ModelConfig.from_file(cfg.model).num_experts, cfg.device)
    from arbor.train.lora import frozen_dtype
    model = load_model(cfg.model, dtype=frozen_dtype(cfg.lora, cfg.dtype) or torch.float32, device=cfg.device, ctx=ctx)
    tok = Tokenizer.load(cfg.model)
    ecfg = engine_config(cfg)
    shares = engine_shares(cfg, sum(p.numel() for p in model.parameters()), ctx.world_size)
    if cfg.lora.enabled or cfg.dist.fsdp:   # the engine serves its own plain copy, refreshed with merged (LoRA)
        from arbor.train.lora import adapt  # or gathered (FSDP) weights at each sync (train.lora, train.fsdp)
        shares = False
    ecfg = dataclasses.replace(ecfg, share_weights=shares)
    engine, sampling = make_engine(model, tok, ecfg, ctx)
    if cfg.lora.enabled:
        adapt(model, cfg.lora, cfg.dtype, cfg.model, cfg.out, tok, ctx)
    task = rl_task(cfg, tok)
    print_notes(task, ctx)
    return RLTrainer(cfg, model, tok, engine, sampling, task, ctx)


def plot_history(history: list[dict], path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r["step"] for r in history if "reward" in r]
    ax.plot(steps, [r["reward"] for r in history if "reward" in r], label="train reward")
    ev = [(r["step"], r["test_accuracy"]) for r in history if "test_accuracy" in r]
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out accuracy")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(cfg, build=build_trainer) -> list[dict]:
    """``arbor train`` in this process: ``build(cfg)`` the trainer (``build_trainer``, or the model
    family's: ``arbor.families``) and run it (``run`` logs every step through ``RunLog``:
    OUT/metrics.jsonl, TensorBoard, W&B, progress bar), plot the rewards, save OUT/final."""
    if build is build_trainer:           # an autoregressive model: the memory plan first (arbor.train.memory_plan)
        import os

        from arbor.train.memory_plan import check as check_memory, from_rl
        check_memory(from_rl(cfg), "arbor train", enforce=cfg.memory_check, show=os.environ.get("RANK", "0") == "0")
    trainer = build(cfg)
    history = asyncio.run(trainer.run())
    if trainer.ctx.is_main:
        plot_history(history, Path(cfg.out) / "reward.png", f"{getattr(trainer.task, 'name', cfg.task)} RL")
    save_trainer(Path(cfg.out) / "final", trainer)
    return history


def evaluate_metrics(model_dir: str, task: str, n: int, device: str = "cpu", build=build_trainer,
                     overrides: list[str] = ()) -> dict:
    """``arbor eval``: the held-out metrics (``arbor.train.rl_eval``) of ``model_dir`` on the first ``n``
    rows of ``data.eval`` (or ``task``'s test split), with the RL config's ``overrides`` (``data.eval=…``,
    ``reward.fns=[…]``, ``tools=[…]``, ``eval.samples=k``)."""
    from arbor import configs
    from arbor.train.config import RLConfig
    cfg = configs.load(RLConfig, None, [f"model={json.dumps(str(model_dir))}", f"task={json.dumps(task)}",
                                        f"device={json.dumps(device)}", f"eval_problems={n}", *overrides])
    trainer = build(cfg)
    if not hasattr(trainer, "evaluate_rows"):             # a block-diffusion trainer: accuracy only
        return {"test_accuracy": asyncio.run(trainer.evaluate(n, progress=True))}
    e = cfg.eval
    metrics, _ = asyncio.run(trainer.evaluate_rows(n, samples=e.samples, temperature=e.temperature, progress=True))
    return metrics
