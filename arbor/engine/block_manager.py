"""Paged KV blocks with prefix caching.

A KV slot is ``block_id * block_size + offset``. A full block's identity is its chain hash
``h_i = hash((h_{i−1}, tokens of block i))`` (h_{−1} = −1), registered once its KV is computed.
Invariants:
- ``ref_count`` = number of sequences whose block table holds the block; a block with
  ref_count 0 is in ``free`` (ordered by free time, reused oldest first) and keeps its hash,
  so it can still be hit until it is reallocated for other tokens;
- a hit needs the hash *and* the stored tokens to match (hash collisions cannot corrupt);
- at most ``(len(seq) − 1) // block_size`` blocks are taken from the cache, so the last
  token is always computed (its logits give the next token);
- with ``states`` (models with linear-attention layers) a hit also needs the recurrent-state
  snapshot after its last block (``StateCache``), so a hit ends at the last block that has one;
- ``prefilling`` maps the hash of every full prompt block an admitted sequence has yet to commit to
  that sequence (entries leave on ``commit`` or ``deallocate``): the scheduler defers a waiting
  sequence whose next uncached block is there (``waits_for_prefill``) rather than compute it twice.
The interface (``can_allocate / allocate / can_append / append_slot / commit / deallocate``)
is what the scheduler uses; a layer-wise or tiered KV manager plugs in behind it.
"""

from __future__ import annotations

from collections import OrderedDict

from arbor.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id, self.ref_count, self.hash, self.token_ids = block_id, 0, None, None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, states=None):
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.states = states        # a StateCache with snapshots, for hybrid models
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefilling: dict[int, Sequence] = {}   # chain hash of a full prompt block → a running sequence computing it
        self.num_hit_tokens = self.num_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens admitted."""
        return self.num_hit_tokens / max(1, self.num_query_tokens)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain_hash(self, parent: int, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    def _lookup(self, seq: Sequence) -> list[tuple[int, int]]:
        """(hash, block_id) of the cached full blocks that prefix ``seq`` (never its last token)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent, bs = [], -1, self.block_size
        for i in range((len(seq) - 1) // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = self._chain_hash(parent, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            hits.append((h, bid))
            parent = h
        if self.states is not None:
            while hits and not self.states.has_snapshot(hits[-1][0]):
                hits.pop()
        return hits

    def _take_free(self) -> Block:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        assert block.ref_count == 0
        if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
            del self.hash_to_block[block.hash]
        block.hash = block.token_ids = None
        block.ref_count = 1
        return block

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._lookup(seq)
        reused_free = sum(1 for _, bid in hits if self.blocks[bid].ref_count == 0)
        return self.blocks_needed(len(seq)) - len(hits) <= self.num_free_blocks - reused_free

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        hits = self._lookup(seq)
        for h, bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free().block_id)
        if self.enable_prefix_caching:
            h, bs = hits[-1][0] if hits else -1, self.block_size
            for i in range(len(hits), (len(seq) - 1) // bs):
                h = self._chain_hash(h, seq.token_ids[i * bs:(i + 1) * bs])
                self.prefilling.setdefault(h, seq)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.num_hit_tokens += seq.num_cached_tokens
        self.num_query_tokens += len(seq)

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) >= self.blocks_needed(len(seq)) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make sure the block of ``seq``'s last token exists."""
        if len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self._take_free().block_id)

    def commit(self, seq: Sequence) -> None:
        """Register the chain hashes of the blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            h = self._chain_hash(seq.block_hashes[-1] if seq.block_hashes else -1, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tokens
            self.hash_to_block.setdefault(h, block.block_id)
            self.prefilling.pop(h, None)
            seq.block_hashes.append(h)

    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, last block first, so a prompt's head stays cached longest."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[bid] = None
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0
        if any(s is seq for s in self.prefilling.values()):
            self.prefilling = {h: s for h, s in self.prefilling.items() if s is not seq}

    def waits_for_prefill(self, seq: Sequence) -> bool:
        """Whether waiting ``seq``'s first full prompt block that the cache does not hold is being computed
        by a running sequence (``prefilling``): admitted now, it would compute that block a second time;
        admitted once the block is committed, it hits it."""
        if not self.prefilling:
            return False
        hits, bs = self._lookup(seq), self.block_size
        i = len(hits)
        if i >= (len(seq) - 1) // bs:
            return False
        return self._chain_hash(hits[-1][0] if hits else -1, seq.token_ids[i * bs:(i + 1) * bs]) in self.prefilling

    def reset_prefix_cache(self) -> None:
        """Forget every hash (after a weight update the cached KV and states are stale)."""
        self.hash_to_block.clear()
        if self.states is not None:
            self.states.clear_snapshots()
        for block in self.blocks:
            if block.ref_count == 0:
                block.hash = block.token_ids = None
