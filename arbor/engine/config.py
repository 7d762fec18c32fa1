"""``EngineConfig``: every engine knob, with defaults that work on a laptop CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """KV pool size: ``num_blocks`` if given, else ``kv_memory_fraction`` of free GPU memory (CUDA)
    or ``kv_cache_bytes`` (CPU), capped at what ``max_num_seqs`` sequences of ``max_model_len``
    tokens need. ``max_model_len`` is clipped to the pool, so one sequence always fits.
    ``logit_noise`` adds noise of scale σ (``logit_noise_dist``: normal N(0, σ²), or heavy-tailed
    cauchy) to the logits of a ``logit_noise_frac`` fraction of sampled positions, before sampling
    and log-probs (to simulate an
    engine whose numerics differ from the trainer's). ``state_snapshots``: recurrent-state snapshots
    kept at block boundaries so that prefix caching also serves models with linear-attention layers
    (each holds every linear layer's state; 0 turns prefix caching off for such models)."""
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_fraction: float = 0.5
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: str = "mixed"
    enable_prefix_caching: bool = True
    state_snapshots: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    logit_noise: float = 0.0
    logit_noise_dist: str = "normal"
    logit_noise_frac: float = 1.0
    progress: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"engine dtype must be one of {sorted(DTYPES)}, got '{self.dtype}'")
        return DTYPES[self.dtype]

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        wanted = self.max_num_seqs * -(-self.max_model_len // self.block_size)
        budget = self.kv_cache_bytes
        if torch.device(self.device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            budget = int(free * self.kv_memory_fraction)
        return max(1, min(wanted, budget // max(1, bytes_per_block)))
