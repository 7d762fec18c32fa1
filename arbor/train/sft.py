"""Supervised fine-tuning on demonstrations: next-token cross-entropy on the loss-masked tokens.

loss = − Σ_t m_t · log π(x_t | x_<t) / Σ_t m_t over each step's batch (token mean), with
batches drawn by a seeded sampler until ``batch_tokens`` tokens, packed into micro-batches of
at most ``micro_tokens`` tokens (gradient accumulation keeps the token mean exact).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from arbor.train.logprobs import packed_logprobs
from arbor.train.optim import OptimConfig, make_optimizer, optimizer_step
from arbor.train.packing import pack_by_tokens


@dataclass
class SFTConfig:
    steps: int = 200
    batch_tokens: int = 4096
    micro_tokens: int = 4096
    seed: int = 0
    log_every: int = 20
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=20))


def draw_batch(rng: random.Random, examples, batch_tokens: int) -> list[int]:
    picked, total = [], 0
    while total < batch_tokens:
        i = rng.randrange(len(examples))
        picked.append(i)
        total += len(examples[i][0])
    return picked


def sft(model, examples: list[tuple[list[int], list[int]]], cfg: SFTConfig, on_log=None) -> list[dict]:
    """examples: (ids, loss_mask) pairs. Trains ``model`` in place; returns the logged metrics."""
    if not examples:
        raise ValueError("sft needs at least one demonstration")
    rng = random.Random(cfg.seed)
    opt = make_optimizer(model, cfg.optim)
    model.train()
    history = []
    for step in range(cfg.steps):
        batch = draw_batch(rng, examples, cfg.batch_tokens)
        n_tokens = sum(sum(examples[i][1]) for i in batch)
        loss_sum = 0.0
        for micro in pack_by_tokens([len(examples[i][0]) for i in batch], cfg.micro_tokens):
            seqs = [examples[batch[j]][0] for j in micro]
            mask = torch.tensor([m for j in micro for m in examples[batch[j]][1]], dtype=torch.float32,
                                device=model.device)
            logp, _ = packed_logprobs(model, seqs)
            loss = -(logp * mask).sum() / max(1, n_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
        stats = optimizer_step(model, opt, step, cfg.steps, cfg.optim)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            row = {"step": step, "loss": loss_sum, **stats}
            history.append(row)
            if on_log:
                on_log(row)
    model.eval()
    return history
