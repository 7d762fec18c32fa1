"""Exact KV cache of finished blocks for block-diffusion decoding.

A block-diffusion model attends bidirectionally inside a block of B positions and causally across
blocks, so the keys/values of a finished block depend only on that block and the blocks before it:
once a block is final its K/V never change and can be cached like an autoregressive prefix.

``BlockCacheAttention`` is an attention-metadata object (the ``attend`` protocol of
``arbor.models.attention``). Each call packs, per sequence, a *segment* = the tokens not yet cached
(finished blocks still to be written, e.g. the prompt's full blocks or the block just committed)
followed by the current block. A segment query at position i sees every cached key and the segment
keys j with block(j) ≤ block(i) — exactly ``BlockDiffusionAttention`` restricted to those queries.
The first ``n_write`` segment tokens (all in blocks before the current one, so they never see it)
have their per-layer K/V appended to the sequence's ``SeqKVCache`` during the call.

Invariant: decoding with this cache yields the same tokens as re-running prompt + all blocks through
``BlockDiffusionAttention`` at every step (tested in tests/test_diffusion_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arbor.models.attention import sdpa


@dataclass
class SeqKVCache:
    """Per-layer K/V ``[C, Hkv, D]`` of one sequence's first ``length`` positions (finished blocks)."""
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0

    def get(self, layer_idx: int, like: torch.Tensor):
        if layer_idx not in self.keys:
            empty = like.new_zeros((0, *like.shape[1:]))
            return empty, empty
        return self.keys[layer_idx], self.values[layer_idx]

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        old_k, old_v = self.get(layer_idx, k)
        self.keys[layer_idx] = torch.cat([old_k, k])
        self.values[layer_idx] = torch.cat([old_v, v])


@dataclass
class BlockCacheAttention:
    caches: list[SeqKVCache]            # one per sequence of the call
    seg_lengths: list[int]              # tokens each sequence contributes to this call
    n_write: list[int]                  # leading segment tokens whose K/V this call appends
    block_size: int
    cu_seqlens = None                   # no linear-attention layers in block-diffusion models
    _blocks: list[torch.Tensor] = field(init=False)

    def __post_init__(self):
        for c, n, w in zip(self.caches, self.seg_lengths, self.n_write):
            assert 0 <= w <= n, "written tokens are a prefix of the segment"
        self._blocks = [None] * len(self.caches)

    @property
    def num_tokens(self) -> int:
        return sum(self.seg_lengths)

    def positions(self, device=None) -> torch.Tensor:
        """Absolute positions: a segment continues right after its sequence's cached prefix."""
        return torch.cat([torch.arange(c.length, c.length + n, device=device)
                          for c, n in zip(self.caches, self.seg_lengths)])

    def _mask(self, i: int, device) -> torch.Tensor:
        c, n = self.caches[i], self.seg_lengths[i]
        block = torch.arange(c.length, c.length + n, device=device) // self.block_size
        inside = block[None, :] <= block[:, None]
        return torch.cat([torch.ones(n, c.length, dtype=torch.bool, device=device), inside], dim=1)

    def attend(self, layer_idx, q, k, v, scale):
        outs, start = [], 0
        for i, (cache, n) in enumerate(zip(self.caches, self.seg_lengths)):
            qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
            ck, cv = cache.get(layer_idx, ks)
            if self._blocks[i] is None:
                self._blocks[i] = self._mask(i, q.device)
            mask = self._blocks[i]
            outs.append(sdpa(qs[None], torch.cat([ck, ks])[None], torch.cat([cv, vs])[None], scale, mask=mask)[0])
            start += n
        self._write(layer_idx, k, v)
        return torch.cat(outs)

    def _write(self, layer_idx, k, v) -> None:
        start = 0
        for cache, n, w in zip(self.caches, self.seg_lengths, self.n_write):
            if w:
                cache.append(layer_idx, k[start:start + w].detach(), v[start:start + w].detach())
            start += n

    def finish(self) -> None:
        """After the forward: the written tokens are now part of each cached prefix."""
        for cache, w in zip(self.caches, self.n_write):
            cache.length += w
