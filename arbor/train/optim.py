"""AdamW with linear warm-up then cosine decay to ``min_lr_ratio · lr``; gradient-norm clipping.

A step whose gradient norm is not finite (a NaN/inf loss or gradient) never reaches the weights:
``optimizer_step`` raises ``NonFiniteError`` naming the step (the run stops before anything of it
is saved), or with ``skip_nonfinite`` drops the gradients and reports ``skipped = 1``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from arbor.train.adamw import AdamW


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    skip_nonfinite: bool = False   # a step whose gradient norm is NaN/inf is skipped (and counted) instead of stopping the run

    def validate(self) -> None:
        from arbor.configs import check
        check(self, (self.lr > 0, "lr", "must be > 0"), (self.weight_decay >= 0, "weight_decay", "must be ≥ 0"),
              (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "must be two numbers in [0, 1)"),
              (self.warmup_steps >= 0, "warmup_steps", "must be ≥ 0"),
              (0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]"), (self.grad_clip > 0, "grad_clip", "must be > 0"))


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """lr(s) = lr·s/warmup for s < warmup, then lr·(m + (1−m)·½(1+cos(π·p))), p = progress after warm-up."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    m = cfg.min_lr_ratio
    return cfg.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> AdamW:
    """AdamW (``arbor.train.adamw``: PyTorch's fused kernel, one pass over a group's parameters) over the
    parameters that require grad. FSDP's sharded parameters (DTensors) and plain ones (experts under EP)
    go in two parameter groups."""
    from arbor.train.fsdp import is_sharded
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = [p for p in params if is_sharded(p)]
    groups = params if len(sharded) in (0, len(params)) else \
        [{"params": sharded}, {"params": [p for p in params if not is_sharded(p)]}]
    return AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


class NonFiniteError(ValueError):
    """A loss or gradient became NaN/inf; the message names the step."""


def optimizer_step(model, optimizer, step: int, total: int, cfg: OptimConfig, ctx=None) -> dict:
    """Clip, set the scheduled lr, step, zero grads; → {"grad_norm", "lr"}. On several ranks
    (``ctx``) gradients are first summed over ranks and clipped by their global norm
    (``arbor.train.distributed``)."""
    if ctx is not None and ctx.distributed:
        from arbor.train.distributed import clip_global, reduce_gradients
        reduce_gradients(model, ctx)
        norm = clip_global(model, cfg.grad_clip, ctx)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    if not math.isfinite(float(norm)):
        optimizer.zero_grad(set_to_none=True)
        if not cfg.skip_nonfinite:
            raise NonFiniteError(f"step {step}: the gradient norm is {float(norm)} (a loss or gradient is not finite); "
                                 "the run stops before this step changes the weights or is saved — the last checkpoint "
                                 "is intact. Lower the learning rate, or set optim.skip_nonfinite=true to skip such steps")
        return {"grad_norm": float(norm), "lr": lr_at(step, total, cfg), "skipped": 1.0}
    lr = lr_at(step, total, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(norm), "lr": lr, "skipped": 0.0}
