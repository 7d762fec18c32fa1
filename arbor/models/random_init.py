"""Random models of a given shape, identical on every rank of an expert-parallel group.

``random_moe_model(shape, ctx, device)`` builds ``CausalLM(ModelConfig(**shape))`` on the meta device,
keeps only this rank's experts (``shard_experts``; all of them on one rank), then materialises what it
holds, so no rank allocates the whole model. Each parameter is drawn from N(0, 0.02²) seeded by
crc32 of its name, and each expert slot by (name seed · 1000 + logical expert id): a rank holding
experts 8…15 has exactly the weights the whole model has there. Norm weights are 1 (0 for Qwen3-Next,
whose norms scale by 1 + w).
"""

from __future__ import annotations

import zlib

import torch

from arbor.models.causal_lm import CausalLM
from arbor.models.config import ModelConfig
from arbor.models.expert_parallel import is_expert_param, shard_experts


def _normal_(t: torch.Tensor, seed: int) -> None:
    t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)


@torch.no_grad()
def random_moe_model(shape: dict, ctx, device) -> CausalLM:
    """The model of ``shape`` (``ModelConfig`` fields), sharded over ``ctx``'s EP group when it has one."""
    cfg = ModelConfig(**shape)
    model = CausalLM.on_meta(cfg)          # every value is set below
    shard_experts(model, ctx)
    model.to_empty(device=device)
    experts = {name: m.expert_ids if hasattr(m, "expert_ids") else list(range(m.num_experts))
               for name, m in model.named_modules() if type(m).__name__ == "Experts"}
    for name, p in model.named_parameters():
        seed = zlib.crc32(name.encode())
        if name.endswith("norm.weight"):
            p.fill_(0.0 if cfg.is_next else 1.0)
        elif is_expert_param(name):
            for slot, e in enumerate(experts[name.rsplit(".", 1)[0]]):
                _normal_(p[slot], seed * 1000 + e)
        else:
            _normal_(p, seed)
    return model
