"""Layer-wise KV (``EngineConfig.layer_kv``): sizes the two tiers and holds what the block manager,
the runner and the ``layerkv`` policy share — the device tier's accounting, the copy engine, the
prefill-time model and the SLO knobs.

Sizes: the device tier holds ``device_kv_blocks`` layer-blocks (default: the engine's usual pool,
``resolve_num_blocks`` blocks of every attention layer — the same bytes); the host tier holds
``host_kv_blocks`` blocks of every layer (default: ``resolve_num_blocks``, the single-tier pool).
One sequence must fit the device tier with every layer offloaded (its double-buffered staging), so
the context is capped at ``capacity // 2`` blocks.
"""

from __future__ import annotations

import weakref

from arbor.engine.kv.transfer import Copier
from arbor.engine.kv.tiers import DeviceTier, TieredBlockManager
from arbor.engine.policies.layerkv_runner import LayerKVRunner
from arbor.engine.policies.slo_admission import PrefillTimeModel


__all__ = ["LayerKV", "LayerKVRunner", "TieredBlockManager"]


INLINE_BYTES = 64 << 10     # CPU copies below this run on the calling thread (a decode step's write-through)


class LayerKV:
    def __init__(self, cfg, num_layers: int, bytes_per_block: int, device):
        """``bytes_per_block``: one block of every attention layer (``KVCache.bytes_per_block``)."""
        self.num_layers = max(1, num_layers)
        self.layer_block_bytes = bytes_per_block // self.num_layers
        capacity = cfg.device_kv_blocks
        if capacity is None:
            capacity = cfg.resolve_num_blocks(bytes_per_block) * self.num_layers
        self.host_blocks = cfg.host_kv_blocks or cfg.resolve_num_blocks(bytes_per_block)
        self.max_seq_blocks = min(self.host_blocks, capacity // 2)
        self.device = DeviceTier(capacity, self.num_layers, cfg.block_size)
        self.copier = Copier(device, INLINE_BYTES)
        weakref.finalize(self, self.copier.close)        # the worker ends with the engine
        self.timing = PrefillTimeModel()
        self.tpot_slo, self.ttft_slo, self.slo_safety = cfg.tpot_slo, cfg.ttft_slo, cfg.slo_safety
        self.block_size = cfg.block_size
        self.num_deferrals = 0

    def write_through_bytes(self, num_tokens: int) -> int:
        """Bytes the copy engine moves to the host tier for ``num_tokens`` tokens (every layer)."""
        return -(-num_tokens // self.block_size) * self.layer_block_bytes * self.num_layers

    def stats(self) -> dict:
        d = self.device
        return {"device_blocks": d.capacity, "host_blocks": self.host_blocks, "device_used": d.used,
                "device_resident": d.resident, "demotions": d.num_demotions,
                "promotions": d.num_promotions, "deferrals": self.num_deferrals,
                **self.copier.stats()}
