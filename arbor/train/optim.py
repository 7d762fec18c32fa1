"""AdamW with linear warm-up then cosine decay to ``min_lr_ratio · lr``; gradient-norm clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

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


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


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
    lr = lr_at(step, total, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(norm), "lr": lr}
