"""The model runner of layer-wise KV: each attention layer reads and writes device blocks only, the
host tier is filled behind it, and offloaded layers are prefetched one layer ahead.

Per forward (``TieredAttention``), with L attention layers and a sequence s keeping r_s of them resident:
- layer a of s uses its resident device blocks when a < r_s, else staging blocks from buffer a mod 2
  (enough for every block s reaches in this step; taken from the device tier's reserve, returned
  when the forward ends);
- prefetch(a): host → staging blocks holding s's computed context (only for a ≥ r_s), plus the device
  copies of prefix-cache hits of resident layers; prefetch(0) and prefetch(1) start with the forward,
  prefetch(a + 2) right after layer a attended (it reuses layer a's buffer), so layer a + 1 computes
  while layer a + 2's KV comes in;
- offload(a): right after layer a wrote its new k, v into device blocks, those of the sequences for
  which layer a is offloaded (a ≥ r_s) are copied to their host slots while the rest of the model
  runs; a resident layer's new KV stays on the device only (its host blocks go stale, written back
  when they leave the device tier: ``arbor.engine.kv.tiers``);
- the write-backs queued since the last forward (``LayerKV.flush``) finish before layer 0 writes a
  device block, and the forward returns only when every copy finished.
Copies run on the ``Copier`` worker (a thread on CPU, a CUDA stream on GPU). The attention over the
device blocks is ``PagedAttention`` itself (one per layer, shared by layers with equal tables), so
the numbers are the single-tier engine's.
"""

from __future__ import annotations

import threading
import time

import torch

from arbor.engine.model_runner import ModelRunner
from arbor.engine.kv.paged import KVCache, PagedAttention
from arbor.models.attention import cu_seqlens_from_lengths


def device_pool(num_layers: int, capacity: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device):
    """One pool of ``capacity`` layer-blocks that every layer indexes: a ``KVCache`` whose ``k[a]``,
    ``v[a]`` are the same storage for each a (a stride-0 layer dimension)."""
    pool = KVCache(1, capacity, block_size, num_kv_heads, head_dim, dtype, device)
    pool.k = pool.k.expand(num_layers, -1, -1, -1)
    pool.v = pool.v.expand(num_layers, -1, -1, -1)
    return pool


class TieredAttention:
    """Attention metadata of one forward over the two tiers (see the module docstring)."""

    def __init__(self, runner: "LayerKVRunner", seqs, starts: list[int], lengths: list[int]):
        tiers, dev, bs = runner.tiers, runner.tiers.device, runner.block_size
        self.runner, self.copier, self.tier = runner, tiers.copier, dev
        self.layer_map = runner.layer_map
        L = self.num_layers = len(runner.layer_map)
        device = runner.device
        self.cu_seqlens = cu_seqlens_from_lengths(lengths, device)
        host_slots = []
        for s, c, n in zip(seqs, starts, lengths):
            host_slots += [s.block_table[p // bs] * bs + p % bs for p in range(c, c + n)]
        self.host_slots = torch.tensor(host_slots, dtype=torch.long)
        dev.promote()
        resident = [dev.resident_layers(s) for s in seqs]
        for s, c, n in zip(seqs, starts, lengths):
            dev.mark_written(s, c // bs, (c + n - 1) // bs)
        self.offload_plans = self._offload_plans(resident, lengths, device)
        tiers.flush()
        self.writebacks, tiers.writebacks = tiers.writebacks, []
        span = [-(-(c + n) // bs) for c, n in zip(starts, lengths)]
        stage = [[dev.take_staging(w) if any(a % 2 == buf for a in range(r, L)) else None
                  for r, w in zip(resident, span)] for buf in (0, 1)]
        fills = dev.pending_fills
        dev.pending_fills = []
        self.layers, built, self.plans = [], {}, []
        for a in range(L):
            key = tuple(a if a < r else -1 - a % 2 for r in resident)
            if key not in built:
                tables = [dev.tables[s.seq_id][a] if a < r else stage[a % 2][i]
                          for i, (s, r) in enumerate(zip(seqs, resident))]
                built[key] = PagedAttention.build(runner.pool, runner.layer_map, tables, starts, lengths, device)
            self.layers.append(built[key])
            src, dst = [], []
            for i, (s, c, r) in enumerate(zip(seqs, starts, resident)):
                if a >= r and c:
                    nbc = -(-c // bs)
                    src += s.block_table[:nbc]
                    dst += stage[a % 2][i][:nbc]
            for _, layer, d, h in fills:
                if layer == a:
                    src.append(h)
                    dst.append(d)
            self.plans.append((torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long, device=device)))
        self.block_bytes = runner.kv.k[0, :bs].nbytes * 2
        self.jobs = [None] * L
        self.offloads = []
        for a in range(min(2, L)):
            self.jobs[a] = self._prefetch(a)

    def _offload_plans(self, resident, lengths, device) -> list:
        """Per layer: None (no sequence offloads it), or (rows of the batch's new tokens or None for
        all, their host slots) of the sequences that offload it."""
        plans, built, L = [], {}, self.num_layers
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        for a in range(L):
            key = tuple(i for i, r in enumerate(resident) if a >= r)
            if key not in built:
                if not key:
                    built[key] = None
                elif len(key) == len(resident):
                    built[key] = (None, self.host_slots)
                else:
                    rows = torch.tensor([t for i in key for t in range(offsets[i], offsets[i + 1])], dtype=torch.long)
                    built[key] = (rows.to(device), self.host_slots[rows])
            plans.append(built[key])
        return plans

    def _prefetch(self, a: int):
        src, dst = self.plans[a]
        if not len(src):
            return None
        host, pool, bs = self.runner.kv, self.runner.pool, self.runner.block_size
        dev = self.runner.device

        def copy():
            for j, (h, d) in enumerate(((host.k[a], pool.k[a]), (host.v[a], pool.v[a]))):
                shape = (-1, bs, *h.shape[1:])
                picked = torch.index_select(h.view(shape), 0, src, out=self.runner.scratch(j, len(src)))
                d.view(shape).index_copy_(0, dst, picked.to(dev, non_blocking=True))

        return self.copier.submit(copy, len(src) * self.block_bytes, "prefetch")

    def attend(self, layer_idx, q, k, v, scale):
        a = self.layer_map[layer_idx]
        while self.writebacks:                  # they read device blocks this forward may overwrite
            self.copier.wait(self.writebacks.pop())
        self.copier.wait(self.jobs[a])
        out = self.layers[a].attend(layer_idx, q, k, v, scale)
        if self.offload_plans[a] is not None:
            self._offload(a, k, v, *self.offload_plans[a])
        if a + 2 < self.num_layers:
            self.jobs[a + 2] = self._prefetch(a + 2)
        return out

    def _offload(self, a: int, k, v, rows, slots) -> None:
        """Copy the new k, v of layer a at ``rows`` (None: all) to their host ``slots`` on the copy engine."""
        if rows is not None:
            k, v = k.index_select(0, rows), v.index_select(0, rows)
        host = self.runner.kv
        self.runner.tiers.host_write_tokens[a] += len(slots)

        def offload():
            kh, vh = k.to("cpu", non_blocking=True), v.to("cpu", non_blocking=True)
            if k.device.type == "cuda":
                torch.cuda.current_stream(k.device).synchronize()
            host.k[a].index_copy_(0, slots, kh)
            host.v[a].index_copy_(0, slots, vh)

        self.offloads.append(self.copier.submit(offload, 2 * k.nbytes, "offload"))

    def finish(self) -> None:
        """Wait for every copy of this forward and hand the staging blocks back."""
        try:
            for job in self.writebacks + self.offloads + self.jobs:
                self.copier.wait(job)
        finally:
            self.tier.return_staging()


class LayerKVRunner(ModelRunner):
    """``ModelRunner`` whose ``kv`` is the host tier (pinned CPU memory on CUDA) and whose forwards
    read and write the device pool ``pool`` through ``TieredAttention``."""

    def __init__(self, *args, tiers=None, **kw):
        self.tiers = tiers
        super().__init__(*args, **kw)
        cfg = self.model.config
        self.pool = device_pool(len(self.layer_map), tiers.device.capacity, self.block_size, cfg.num_key_value_heads,
                                cfg.head_dim, self.model.dtype, self.device)
        self._attn: TieredAttention | None = None
        self._scratch: list[torch.Tensor | None] = [None, None]
        self._pinned = torch.device(self.device).type == "cuda"
        tiers.host_kv, tiers.pool = self.kv, self.pool

    def scratch(self, j: int, num_blocks: int) -> torch.Tensor:
        """A reused host buffer [num_blocks, block_size, Hkv, D] for k (j = 0) or v (j = 1) of one
        prefetch: fresh multi-MB buffers cost more in page faults than the copy. On the copy worker
        it is the worker's own (jobs run one at a time); elsewhere (an inline copy) a new one."""
        shape = (num_blocks, self.block_size, *self.kv.k.shape[2:])
        if threading.current_thread() is not self.tiers.copier.thread:
            return torch.empty(shape, dtype=self.kv.k.dtype, pin_memory=self._pinned)
        buf = self._scratch[j]
        if buf is None or buf.shape[0] < num_blocks:
            buf = torch.empty((max(num_blocks, 2 * (0 if buf is None else buf.shape[0])), *shape[1:]),
                              dtype=self.kv.k.dtype, pin_memory=self._pinned)
            self._scratch[j] = buf
        return buf[:num_blocks]

    def make_cache(self, num_blocks: int) -> KVCache:
        cfg = self.model.config
        host = KVCache(len(self.layer_map), num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim,
                       self.model.dtype, "cpu")
        if torch.device(self.device).type == "cuda":
            host.k, host.v = host.k.pin_memory(), host.v.pin_memory()
        return host

    def attention(self, seqs, starts, lengths):
        self._attn = TieredAttention(self, seqs, starts, lengths)
        return self._attn

    def run_segments(self, batch, layers_per_segment=None, return_routing=False):
        """``ModelRunner.run_segments``, finishing the forward's copies before its result is handed
        out, and timing the forward for the prefill-time model (``tiers.timing``)."""
        t0 = time.perf_counter()
        try:
            for done, result in super().run_segments(batch, layers_per_segment, return_routing):
                if result is not None:
                    self._attn.finish()
                    self.tiers.timing.observe(sum(n for _, n in batch if n > 1), sum(n == 1 for _, n in batch),
                                              time.perf_counter() - t0)
                yield done, result
        finally:
            if self.tiers.device.staging:
                self.tiers.device.return_staging()
