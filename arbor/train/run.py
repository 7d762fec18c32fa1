"""``arbor train`` / ``arbor eval``: build model, engine and trainer from a config and run them.

The engine is colocated with the trainer (same process). In the trainer's dtype and device it
serves the trainer's own module, so weight sync moves nothing; in another dtype it holds a copy
that ``update_weights`` refreshes after every optimizer step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from arbor.models.config import torch_dtypes

DTYPES = torch_dtypes()


def make_engine(model, tokenizer, dtype: str = "float32", device: str = "cpu", logit_noise: float = 0.0,
                max_model_len: int = 1024, ctx=None, noise_dist: str = "normal", noise_frac: float = 1.0,
                policy: str = "mixed", pd_segment_layers: int = 1, share_weights: bool = True):
    """→ (AsyncLLMEngine, sampling_factory(max_tokens, temperature, top_p, seed, ignore_eos)).
    ``share_weights=False``: even in the trainer's dtype the engine keeps its own copy (on CPU in
    float32: oneDNN-packed linears), which ``update_weights`` refreshes and repacks."""
    from arbor.engine import AsyncLLMEngine, EngineConfig, SamplingParams
    if dtype not in DTYPES:
        raise ValueError(f"engine dtype must be one of {sorted(DTYPES)}, got '{dtype}'")
    cfg = EngineConfig(dtype=dtype, device=device, logit_noise=logit_noise, max_model_len=max_model_len,
                       logit_noise_dist=noise_dist, logit_noise_frac=noise_frac, policy=policy,
                       pd_segment_layers=pd_segment_layers, share_weights=share_weights)
    engine = AsyncLLMEngine(model, cfg, tokenizer=tokenizer, ctx=ctx)
    eos, moe = tokenizer.eos_token_id, bool(model.config.moe_layers)

    def sampling(max_tokens, temperature, top_p, seed, ignore_eos=False):
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              stop_token_ids=[] if ignore_eos else [eos], ignore_eos=ignore_eos,
                              return_routed_experts=moe)   # MoE: trajectories carry the engine's expert ids

    return engine, sampling


def build_trainer(cfg):
    """Model, engine and trainer of ``cfg`` (a block-diffusion model gets ``EBPOTrainer``); under ``arbor launch`` / torchrun each rank builds its
    own, with the experts of an MoE model split over ``dist.ep_size`` ranks."""
    from arbor.distributed import init_distributed
    from arbor.models import ModelConfig, load_model
    from arbor.models.tokenizer import Tokenizer
    from arbor.tasks.registry import get_task
    from arbor.train.rl import RLTrainer
    if ModelConfig.from_file(cfg.model).is_block_diffusion:     # EBPO: diffusion rollouts, block-ELBO ratio
        from arbor.dllm.ebpo_trainer import build_ebpo_trainer
        return build_ebpo_trainer(cfg)
    torch.manual_seed(cfg.seed)
    ctx = init_distributed(cfg.dist, ModelConfig.from_file(cfg.model).num_experts, cfg.device)
    model = load_model(cfg.model, dtype=torch.float32, device=cfg.device, ctx=ctx)
    tok = Tokenizer.load(cfg.model)
    engine, sampling = make_engine(model, tok, cfg.engine_dtype, cfg.device, cfg.engine_logit_noise,
                                   cfg.rollout.max_context + 64, ctx, cfg.engine_noise_dist, cfg.engine_noise_frac,
                                   cfg.rollout.policy, cfg.rollout.pd_segment_layers, cfg.engine_share_weights)
    return RLTrainer(cfg, model, tok, engine, sampling, get_task(cfg.task), ctx)


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


def train(cfg) -> list[dict]:
    """``arbor train``: build and run the trainer (``RLTrainer.run`` logs every step through
    ``RunLog``: OUT/metrics.jsonl, TensorBoard, W&B, progress bar), plot the rewards, save OUT/final."""
    trainer = build_trainer(cfg)
    history = asyncio.run(trainer.run())
    if trainer.ctx.is_main:
        plot_history(history, Path(cfg.out) / "reward.png", f"{cfg.task} RL")
    trainer.save(Path(cfg.out) / "final")
    return history


def evaluate_folder(model_dir: str, task: str, n: int, device: str = "cpu") -> float:
    from arbor.train.rl import RLConfig
    cfg = RLConfig(model=model_dir, task=task, device=device, eval_problems=n)
    trainer = build_trainer(cfg)
    return asyncio.run(trainer.evaluate(n, progress=True))
