"""The paged KV cache and the attention metadata that reads and writes it.

``KVCache.k[a]``, ``.v[a]``: [num_blocks · block_size, Hkv, D] for the a-th softmax layer; token
at position p of a sequence lives in slot ``block_table[p // bs] · bs + p % bs``.

``PagedAttention`` serves one forward over packed query tokens: the decodes first (one query
each), then the prefill chunks. ``attend`` writes the new k, v into their slots, then reads
context back whole blocks at a time (``KVCache.gather_blocks``: one contiguous copy per block,
the tail of a sequence's last block masked off):
- decodes (sorted by decreasing context): a few batched SDPAs, one per group of similar context
  lengths, over the gathered blocks [B_g, W_g · block_size] with a length mask;
- a chunk starting at position c: queries c..c+n−1 see keys 0..c+i (causal); a chunk with
  c = 0 attends over its own k, v without touching the cache.
On CPU the C kernels of ``cpu_attention`` replace both where they run: decodes read their blocks in
place (``decode_kernel``), and every prefill chunk reads its keys — its own included, written just
before — from the cache in one call (``prefill_kernel``: no gather copy of the context).
All index tensors are built once per step (``build``) and shared by every layer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import accumulate

import torch

from arbor.kernels import cpu_attention
from arbor.models.attention import sdpa, cu_seqlens_from_lengths


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype, device):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self._local = threading.local()     # gather_blocks' buffer, one per thread (P and D workers)

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def gather_blocks(self, layer: int, blocks: torch.Tensor):
        """(k, v) [len(blocks) · block_size, Hkv, D] of one layer: the given blocks back to back,
        copied into a reused buffer of the calling thread (valid until its next call): fresh multi-MB
        allocations cost more in page faults than the copy itself."""
        n = blocks.shape[0] * self.block_size
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[1] < n:
            buf = self._local.buf = torch.empty(2, max(n, 2 * (0 if buf is None else buf.shape[1])), *self.k.shape[2:],
                                                dtype=self.k.dtype, device=self.k.device)
        k, v = buf[0, :n], buf[1, :n]
        shape = (-1, self.block_size, *self.k.shape[2:])
        torch.index_select(self.k[layer].view(shape), 0, blocks, out=k.view(shape))
        torch.index_select(self.v[layer].view(shape), 0, blocks, out=v.view(shape))
        return k, v


@dataclass
class Chunk:
    start: int                   # first query token in the packed batch
    length: int                  # number of query tokens
    context: int                 # tokens before the chunk (cached or computed earlier)
    blocks: torch.Tensor | None  # [W] blocks holding keys 0..context+length−1 (None when context == 0)
    mask: torch.Tensor | None    # [length, W · block_size] causal


@dataclass
class DecodeGroup:
    start: int                   # first decode (query token) of the group
    count: int
    blocks: torch.Tensor         # [count · W] block tables, row-major, padded with block 0
    mask: torch.Tensor           # [count, 1, 1, W · block_size] True for real context


def decode_groups(lengths: list[int], waste: float = 0.7, max_groups: int = 4) -> list[tuple[int, int]]:
    """Split decodes sorted by decreasing context length into ≤ max_groups runs whose shortest
    context is ≥ waste × its longest (less padding, few SDPA calls). → [(start, count)]."""
    groups, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (lengths[i] < waste * lengths[start] and len(groups) < max_groups - 1):
            groups.append((start, i - start))
            start = i
    return groups


@dataclass
class PagedAttention:
    cache: KVCache
    layer_map: dict[int, int]         # model layer index → KV-cache layer
    slot_mapping: torch.Tensor        # [T] slot of each query token
    cu_seqlens: torch.Tensor          # [N + 1] query-token boundaries (linear-attention layers)
    num_decodes: int
    decodes: list[DecodeGroup]
    chunks: list[Chunk]
    decode_kernel: tuple[torch.Tensor, torch.Tensor] | None = None   # (block tables [nd, W], contexts [nd]) int32
    prefill_kernel: tuple[torch.Tensor, torch.Tensor] | None = None  # (block tables [C, W], [first row, length, context] × C) int32

    @classmethod
    def build(cls, cache: KVCache, layer_map, block_tables: list[list[int]], starts: list[int], lengths: list[int],
              device) -> "PagedAttention":
        """Sequences in order (decodes, lengths 1, first); starts[i] = tokens already in the cache."""
        bs = cache.block_size
        slots = []
        for table, c, n in zip(block_tables, starts, lengths):
            slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
        nd = 0
        while nd < len(lengths) and lengths[nd] == 1:
            nd += 1
        groups, kernel = [], None
        if nd:
            ctx = [c + 1 for c in starts[:nd]]
            if any(a < b for a, b in zip(ctx, ctx[1:])):
                raise ValueError("decodes must come sorted by decreasing context length")
        if nd and cpu_attention.supports(device, cache.k.dtype):
            width = -(-ctx[0] // bs)
            tables = [t[:width] + [0] * (width - len(t[:width])) for t in block_tables[:nd]]
            kernel = (torch.tensor(tables, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32))
        elif nd:
            for g0, cnt in decode_groups(ctx):
                width = -(-ctx[g0] // bs)
                tables = [t[:width] + [0] * (width - len(t[:width])) for t in block_tables[g0:g0 + cnt]]
                pos = torch.arange(width * bs)
                mask = (pos[None, :] < torch.tensor(ctx[g0:g0 + cnt])[:, None])[:, None, None, :].to(device)
                groups.append(DecodeGroup(g0, cnt, torch.tensor(tables, device=device).view(-1), mask))
        chunks, t, prefill = [], nd, None
        if (len(lengths) > nd and (kernel is not None or not nd)      # the two kernels share one output
                and cpu_attention.supports_prefill(device, cache.k.dtype, cache.k.shape[-1], bs)):
            width = max(-(-(c + n) // bs) for c, n in zip(starts[nd:], lengths[nd:]))
            tables = [tb[:width] + [0] * (width - len(tb[:width])) for tb in block_tables[nd:]]
            rows = list(accumulate(lengths[nd:-1], initial=nd))
            prefill = (torch.tensor(tables, dtype=torch.int32),
                       torch.tensor([rows, lengths[nd:], starts[nd:]], dtype=torch.int32))
        for table, c, n in zip(block_tables[nd:], starts[nd:], lengths[nd:]) if prefill is None else ():
            blocks = mask = None
            if c:
                width = -(-(c + n) // bs)
                blocks = torch.tensor(table[:width], device=device)
                mask = (torch.arange(width * bs)[None, :] <= torch.arange(c, c + n)[:, None]).to(device)
            chunks.append(Chunk(t, n, c, blocks, mask))
            t += n
        return cls(cache, layer_map, torch.tensor(slots, device=device), cu_seqlens_from_lengths(lengths, device),
                   nd, groups, chunks, kernel, prefill)

    def attend(self, layer_idx, q, k, v, scale):
        a = self.layer_map[layer_idx]
        kc, vc = self.cache.k[a], self.cache.v[a]
        kc.index_copy_(0, self.slot_mapping, k)
        vc.index_copy_(0, self.slot_mapping, v)
        if self.prefill_kernel is not None:   # (then decodes, if any, have their kernel too: build)
            out = torch.empty_like(q, memory_format=torch.contiguous_format)   # both kernels write their rows
            if self.num_decodes:
                cpu_attention.paged_decode_attention(q[:self.num_decodes], kc, vc, *self.decode_kernel,
                                                     self.cache.block_size, scale, out=out[:self.num_decodes])
            return cpu_attention.paged_prefill_attention(q, kc, vc, *self.prefill_kernel, self.cache.block_size,
                                                         scale, out=out)
        outs = []
        if self.decode_kernel is not None:
            outs.append(cpu_attention.paged_decode_attention(q[:self.num_decodes], kc, vc, *self.decode_kernel,
                                                             self.cache.block_size, scale))
        for g in self.decodes:
            keys, values = self.cache.gather_blocks(a, g.blocks)
            shape = (g.count, -1, *k.shape[1:])
            outs.append(sdpa(q[g.start:g.start + g.count, None], keys.view(shape), values.view(shape), scale,
                              mask=g.mask)[:, 0])
        for ch in self.chunks:
            qs = q[None, ch.start:ch.start + ch.length]
            if ch.blocks is None:
                ks, vs = k[None, ch.start:ch.start + ch.length], v[None, ch.start:ch.start + ch.length]
                outs.append(sdpa(qs, ks, vs, scale, causal=True)[0])
            else:
                keys, values = self.cache.gather_blocks(a, ch.blocks)
                outs.append(sdpa(qs, keys[None], values[None], scale, mask=ch.mask)[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)
