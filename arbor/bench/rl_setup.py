"""Shared set-up of the RL benchmarks: a colocated trainer on a tiny random model."""

from __future__ import annotations

import copy

import torch

from arbor.models import CausalLM
from arbor.models.presets import preset_config
from arbor.models.tokenizer import builtin_tokenizer
from arbor.train.config import RLConfig, engine_config
from arbor.train.rl import RLTrainer
from arbor.train.run import make_engine, rl_task


def tiny_model(preset: str = "tiny", seed: int = 0, device="cpu"):
    tok = builtin_tokenizer()
    torch.manual_seed(seed)
    return CausalLM(preset_config(preset, tok)).to(device).eval(), tok


def make_trainer(cfg: RLConfig, model, tok) -> RLTrainer:
    """A trainer on its own copy of ``model`` (so runs compared side by side start equal)."""
    model = copy.deepcopy(model)
    engine, sampling = make_engine(model, tok, engine_config(cfg))
    return RLTrainer(cfg, model, tok, engine, sampling, rl_task(cfg, tok))
