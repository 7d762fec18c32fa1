"""Layer-wise KV (``EngineConfig.layer_kv``): sizes the two tiers and holds what the block manager,
the runner and the ``layerkv`` policy share — the device tier's accounting, the copy engine, the
prefill-time model and the SLO knobs.

Sizes: the device tier holds ``device_kv_blocks`` layer-blocks (default: the engine's usual pool,
``resolve_num_blocks`` blocks of every attention layer — the same bytes); the host tier holds
``host_kv_blocks`` blocks of every layer (default: ``resolve_num_blocks``, the single-tier pool).
One sequence must fit the device tier with every layer offloaded (its double-buffered staging), so
the context is capped at ``capacity // 2`` blocks.

Host writes are counted per attention layer (``host_write_tokens``: tokens of KV copied device → host,
offloads and write-backs) and by the copier per kind (``offload``, ``writeback``), so the traffic of
resident layers — none while they stay resident — can be checked.
"""

from __future__ import annotations

import weakref

import torch

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
        self.host_write_tokens = [0] * self.num_layers
        self.host_kv = self.pool = None          # set by LayerKVRunner: the host tier and the device pool
        self.writebacks: list = []               # write-back jobs the next forward waits for

    def offload_bytes(self, num_tokens: int, resident: int) -> int:
        """Bytes the copy engine moves to the host tier for ``num_tokens`` new tokens of a sequence that
        keeps ``resident`` layers on the device (only the other layers are offloaded)."""
        return -(-num_tokens // self.block_size) * self.layer_block_bytes * (self.num_layers - resident)

    def flush(self) -> None:
        """Start the device tier's queued write-backs (device → host copies of whole layer-blocks) on
        the copy engine; the next forward waits for them before it writes a device block."""
        todo, self.device.pending_writebacks = self.device.pending_writebacks, []
        if not todo:
            return
        host, pool, n_host = self.host_kv, self.pool, self.host_kv.k.shape[1] // self.block_size
        src = torch.tensor([d for _, d, _ in todo], dtype=torch.long, device=pool.k.device)
        dst = torch.tensor([a * n_host + h for a, _, h in todo], dtype=torch.long)
        for a, _, _ in todo:
            self.host_write_tokens[a] += self.block_size

        def copy():
            for h, d in ((host.k, pool.k[0]), (host.v, pool.v[0])):
                shape = (-1, self.block_size, *d.shape[1:])
                blocks = d.view(shape).index_select(0, src).to("cpu", non_blocking=True)
                if d.device.type == "cuda":
                    torch.cuda.current_stream(d.device).synchronize()
                h.view(shape).index_copy_(0, dst, blocks)

        self.writebacks.append(self.copier.submit(copy, len(todo) * self.layer_block_bytes, "writeback"))

    def stats(self) -> dict:
        d = self.device
        return {"device_blocks": d.capacity, "host_blocks": self.host_blocks, "device_used": d.used,
                "device_resident": d.resident, "demotions": d.num_demotions,
                "promotions": d.num_promotions, "deferrals": self.num_deferrals,
                **self.copier.stats()}
