"""The paged KV cache and the attention metadata that reads and writes it.

``KVCache.k[a]``, ``.v[a]``: [num_blocks · block_size, Hkv, D] for the a-th softmax layer; token
at position p of a sequence lives in slot ``block_table[p // bs] · bs + p % bs``.

``PagedAttention`` serves one forward over packed query tokens: the decodes first (one query
each), then the prefill chunks. ``attend`` writes the new k, v into their slots, then
- decodes: one batched SDPA over each sequence's gathered context [B, S_max] with a length mask;
- a chunk starting at position c: queries c..c+n−1 see keys 0..c+i (causal); a chunk with
  c = 0 attends over its own k, v without touching the cache.
All index tensors are built once per step (``build``) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from arbor.models.attention import cu_seqlens_from_lengths


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype, device):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _sdpa(q, k, v, scale, mask=None, causal=False):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] → [B, T, Hq, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@dataclass
class Chunk:
    start: int                   # first query token in the packed batch
    length: int                  # number of query tokens
    context: int                 # tokens before the chunk (cached or computed earlier)
    slots: torch.Tensor | None   # [context + length] slots of all keys (None when context == 0)
    mask: torch.Tensor | None    # [length, context + length] causal


@dataclass
class PagedAttention:
    cache: KVCache
    layer_map: dict[int, int]         # model layer index → KV-cache layer
    slot_mapping: torch.Tensor        # [T] slot of each query token
    cu_seqlens: torch.Tensor          # [N + 1] query-token boundaries (linear-attention layers)
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B, S_max]
    decode_mask: torch.Tensor | None   # [B, 1, 1, S_max]
    chunks: list[Chunk]

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
        decode_slots = decode_mask = None
        if nd:
            ctx = torch.tensor([c + 1 for c in starts[:nd]])
            width = max(len(t) for t in block_tables[:nd])
            tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables[:nd]])
            pos = torch.arange(int(ctx.max()))
            decode_slots = (tables[:, pos // bs] * bs + pos % bs).to(device)
            decode_mask = (pos[None, :] < ctx[:, None])[:, None, None, :].to(device)
        chunks, t = [], nd
        for table, c, n in zip(block_tables[nd:], starts[nd:], lengths[nd:]):
            chunk_slots = mask = None
            if c:
                pos = torch.arange(c + n)
                chunk_slots = (torch.tensor(table)[pos // bs] * bs + pos % bs).to(device)
                mask = (pos[None, :] <= torch.arange(c, c + n)[:, None]).to(device)
            chunks.append(Chunk(t, n, c, chunk_slots, mask))
            t += n
        return cls(cache, layer_map, torch.tensor(slots, device=device), cu_seqlens_from_lengths(lengths, device),
                   nd, decode_slots, decode_mask, chunks)

    def attend(self, layer_idx, q, k, v, scale):
        a = self.layer_map[layer_idx]
        kc, vc = self.cache.k[a], self.cache.v[a]
        kc.index_copy_(0, self.slot_mapping, k)
        vc.index_copy_(0, self.slot_mapping, v)
        outs = []
        nd = self.num_decodes
        if nd:
            outs.append(_sdpa(q[:nd, None], kc[self.decode_slots], vc[self.decode_slots], scale,
                              mask=self.decode_mask)[:, 0])
        for ch in self.chunks:
            qs = q[None, ch.start:ch.start + ch.length]
            if ch.slots is None:
                ks, vs = k[None, ch.start:ch.start + ch.length], v[None, ch.start:ch.start + ch.length]
                outs.append(_sdpa(qs, ks, vs, scale, causal=True)[0])
            else:
                outs.append(_sdpa(qs, kc[ch.slots][None], vc[ch.slots][None], scale, mask=ch.mask)[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)
