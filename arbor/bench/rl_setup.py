"""Shared set-up of the RL benchmarks: a colocated trainer on a tiny random model."""

from __future__ import annotations

import copy

import torch

from arbor.models import CausalLM
from arbor.models.presets import preset_config
from arbor.models.tokenizer import builtin_tokenizer
from arbor.tasks.registry import get_task
from arbor.train.rl import RLConfig, RLTrainer
from arbor.train.run import make_engine


def tiny_model(preset: str = "tiny", seed: int = 0, device="cpu"):
    tok = builtin_tokenizer()
    torch.manual_seed(seed)
    return CausalLM(preset_config(preset, tok)).to(device).eval(), tok


def make_trainer(cfg: RLConfig, model, tok) -> RLTrainer:
    """A trainer on its own copy of ``model`` (so runs compared side by side start equal)."""
    model = copy.deepcopy(model)
    engine, sampling = make_engine(model, tok, cfg.engine_dtype, cfg.device, cfg.engine_logit_noise,
                                   cfg.rollout.max_context + 64, None, cfg.engine_noise_dist, cfg.engine_noise_frac,
                                   cfg.rollout.policy, cfg.rollout.pd_segment_layers, cfg.engine_share_weights)
    return RLTrainer(cfg, model, tok, engine, sampling, get_task(cfg.task))
