"""Tree attention computed per fork-free run: the metadata the trainer's tree rows use.

For each fork-free run s of a tree (``arbor.models.tree_linear.tree_segments``), queries of s attend
to the keys of all ancestor runs and causally inside s — exactly ancestors + self, as
``TreeAttention``'s dense [T, T] mask says, with cost Σ_i depth(i) instead of T².
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arbor.models.attention import sdpa
from arbor.models.rows import take_rows
from arbor.models.tree_linear import Segments, segment_depths, tree_segments


@dataclass
class SegmentTreeAttention:
    """Tree attention metadata (token sees itself and its ancestors) computed per fork-free run."""

    parents: torch.Tensor
    linear_replay: bool = True
    segments: Segments = field(init=False)
    cu_seqlens = None

    def __post_init__(self):
        self.segments = tree_segments(self.parents.tolist())
        seg, dev = self.segments, self.parents.device
        self._keys, self._masks = [], []
        for s in range(len(seg)):
            chain, cur = [], s
            while cur >= 0:
                chain.append(cur)
                cur = seg.parent[cur]
            keys = torch.cat([torch.arange(seg.start[c], seg.end[c]) for c in reversed(chain)])
            n = seg.end[s] - seg.start[s]
            ctx = keys.numel() - n
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            mask = torch.cat([torch.ones(n, ctx, dtype=torch.bool), mask], 1)
            self._keys.append(keys.to(dev))
            self._masks.append(None if ctx == 0 else mask.to(dev))
        # one gather of every run's keys per layer, split per run: autograd then accumulates k/v's
        # gradient in one index_add (a slice or index per run would zero-fill a full-size gradient each)
        self._all_keys = torch.cat(self._keys) if self._keys else torch.zeros(0, dtype=torch.long, device=dev)
        self._key_lens = [k.numel() for k in self._keys]
        self._q_lens = [e - b for b, e in zip(seg.start, seg.end)]   # runs tile the tokens in order

    @property
    def num_tokens(self) -> int:
        return self.parents.shape[0]

    def positions(self) -> torch.Tensor:
        return segment_depths(self.segments, self.num_tokens).to(self.parents.device)

    def attend(self, layer_idx, q, k, v, scale):
        if not self._keys:
            return q[:0]
        ks = take_rows(k, self._all_keys).split(self._key_lens)
        vs = take_rows(v, self._all_keys).split(self._key_lens)
        outs = []
        for qs, ks_, vs_, mask in zip(q.split(self._q_lens), ks, vs, self._masks):
            # mask None: a root run, plain causal attention over itself
            outs.append(sdpa(qs[None], ks_[None], vs_[None], scale, mask=mask, causal=mask is None)[0])
        return torch.cat(outs)
