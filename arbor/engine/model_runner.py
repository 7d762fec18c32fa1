"""Runs one scheduled batch through the model over the paged KV cache.

Token order of a step: decodes (1 token each, longest context first) first, then prefill chunks, each sequence's
tokens contiguous — the order of ``PagedAttention.cu_seqlens`` and of the linear-attention
states gathered from the ``StateCache``. Returns the float32 logits of the last scheduled token
of every sequence whose chunk reaches its last token (those sample this step).
"""

from __future__ import annotations

import contextlib

import torch

from arbor.engine.decode_stack import DecodeStack
from arbor.engine.kv.paged import KVCache, PagedAttention
from arbor.engine.sequence import Sequence
from arbor.engine.kv.state_cache import StateCache
from arbor.models.causal_lm import ModelOutput


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int, logit_noise: float = 0.0,
                 seed: int = 0, num_state_snapshots: int = 0, noise_dist: str = "normal", noise_frac: float = 1.0):
        self.model, cfg = model, model.config
        self.block_size = block_size
        self.device = model.device
        self.layer_map = {i: a for a, i in enumerate(
            i for i, t in enumerate(cfg.layer_types) if t == "full_attention")}
        self.kv = self.make_cache(num_blocks)
        self.states = StateCache(model, max_num_seqs, self.device, num_state_snapshots)
        if noise_dist not in ("normal", "cauchy"):
            raise ValueError(f"logit_noise_dist must be normal or cauchy, got '{noise_dist}'")
        if not 0 <= noise_frac <= 1:
            raise ValueError(f"logit_noise_frac must be in [0, 1], got {noise_frac}")
        self.logit_noise, self.noise_dist, self.noise_frac = logit_noise, noise_dist, noise_frac
        self.noise_generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.lock = contextlib.nullcontext()    # the engine's lock: state slots and the noise generator
        self.decode_stack = DecodeStack.for_model(model, self.kv, self.layer_map)   # decode steps in one C call

    def make_cache(self, num_blocks: int) -> KVCache:
        """The paged KV pool (``LayerKVRunner``: the host tier)."""
        cfg = self.model.config
        return KVCache(len(self.layer_map), num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim,
                       self.model.dtype, self.device)

    def attention(self, seqs: list[Sequence], starts: list[int], lengths: list[int]):
        """The attention metadata of one forward (``LayerKVRunner``: over the two KV tiers)."""
        return PagedAttention.build(self.kv, self.layer_map, [s.block_table for s in seqs], starts, lengths,
                                    self.device)

    def run(self, batch: list[tuple[Sequence, int]], return_routing: bool = False):
        """→ (batch in token order, seqs that sample, logits [B, V] float32, routing [num_moe_layers, T, k]
        or None, token offset of each scheduled sequence in the packed batch)."""
        for _, result in self.run_segments(batch, None, return_routing):
            pass
        return result

    @torch.inference_mode()
    def run_segments(self, batch: list[tuple[Sequence, int]], layers_per_segment: int | None = None,
                     return_routing: bool = False):
        """``run`` cut at ``CausalLM.forward_segments``' boundaries (None: one segment): a generator
        that yields ``(layers done, None)`` at every boundary and ``(num_layers, run's result)`` last.
        Between two segments the caller may run other batches over other sequences (P/D multiplexing):
        this batch's KV slots and state slots are its own."""
        batch = sorted(batch, key=lambda item: (item[1] != 1, -item[0].num_computed_tokens if item[1] == 1 else 0))
        seqs = [s for s, _ in batch]
        lengths = [n for _, n in batch]
        starts = [s.num_computed_tokens for s in seqs]
        if all(n == 1 for n in lengths):
            ids = [s.token_ids[c] for s, c in zip(seqs, starts)]   # a decode's last token, or a 1-token prefill chunk's
            positions = starts
        else:
            ids, positions = [], []
            for s, c, n in zip(seqs, starts, lengths):
                ids += s.token_ids[c:c + n]
                positions += range(c, c + n)
        dev = self.device
        attn = self.attention(seqs, starts, lengths)
        states = slots = None
        if self.states:
            with self.lock:
                self._take_state_slots(seqs)
            slots = torch.tensor([s.state_slot for s in seqs], device=dev)
            states = self.states.gather(slots, len(self.model.model.layers))
        num_layers = len(self.model.model.layers)
        if (self.decode_stack is not None and states is None and not return_routing
                and (layers_per_segment or num_layers) >= num_layers and self.decode_stack.serves(attn, len(ids))):
            done, out = num_layers, ModelOutput(self.decode_stack.run(torch.tensor(ids), torch.tensor(positions), attn),
                                                None, None)
        else:
            for done, out in self.model.forward_segments(
                    torch.tensor(ids, device=dev), attn, layers_per_segment or num_layers,
                    positions=torch.tensor(positions, device=dev), states=states, return_routing=return_routing):
                if out is None:
                    yield done, None
        if self.states:
            self.states.scatter(slots, out.states)
        ends = attn.cu_seqlens[1:].tolist()
        sample = [i for i, (s, c, n) in enumerate(zip(seqs, starts, lengths)) if c + n == len(s)]
        last = torch.tensor([ends[i] - 1 for i in sample], dtype=torch.long, device=dev)
        logits = self.model.logits(out.hidden[last]).float()
        if self.logit_noise:
            with self.lock:
                logits = logits + self._noise(logits.shape, dev)
        offsets = [e - n for e, n in zip(ends, lengths)]
        yield done, (batch, [seqs[i] for i in sample], logits, out.routed_experts, offsets)

    def _take_state_slots(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.state_slot is None:
                s.state_slot = self.states.take()
                if s.num_computed_tokens:   # a prefix-cache hit: its last block has a snapshot
                    key = s.block_hashes[s.num_computed_tokens // self.block_size - 1]
                    self.states.restore_snapshot(s.state_slot, key)

    def _noise(self, shape, dev) -> torch.Tensor:
        """σ · (N(0, 1) or standard Cauchy) per logit, on a ``noise_frac`` fraction of the rows."""
        g = self.noise_generator
        if self.noise_dist == "cauchy":
            z = torch.empty(shape, device=dev).cauchy_(generator=g)
        else:
            z = torch.randn(shape, generator=g, device=dev)
        if self.noise_frac < 1:
            z = z * (torch.rand(shape[0], 1, generator=g, device=dev) < self.noise_frac)
        return self.logit_noise * z

    def save_states(self, seqs: list[Sequence]) -> None:
        """Snapshot the states of sequences whose computed tokens end at a committed block boundary."""
        if not self.states.num_snapshots:
            return
        for s in seqs:
            full = s.num_computed_tokens // self.block_size
            if s.num_computed_tokens % self.block_size == 0 and full and len(s.block_hashes) >= full:
                self.states.save_snapshot(s.state_slot, s.block_hashes[full - 1])

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None
