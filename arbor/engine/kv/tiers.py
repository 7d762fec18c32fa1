"""Two KV tiers with per-layer residency (LayerKV): a bounded device tier of layer-blocks and a
host tier of whole blocks, behind the ``BlockManager`` interface the scheduler already uses.

- Host tier: the ``BlockManager``'s blocks (all attention layers each; on CUDA pinned CPU memory,
  on CPU a RAM pool). Block ids in ``seq.block_table`` are host blocks, so prefix caching (hashes,
  ref counts, LRU reuse) works unchanged across tiers.
- Device tier: ``capacity`` layer-blocks (``block_size`` tokens of one attention layer each).
  A sequence keeps layers ``0 .. r−1`` resident (``r = resident_layers(seq)``): per resident layer a
  block table of device blocks parallel to its host block table — the per-layer block tables.
  Layers ``r .. L−1`` live on the host only; a forward reads them through staging device blocks
  (``arbor.engine.policies.layerkv_runner``), two buffers (layer l and the prefetch of l + 1).

Only KV that leaves the device tier goes to the host: the new k, v of an offloaded layer (written
by the forward), and a resident layer's blocks when they leave — demotion, release of blocks the
prefix cache keeps, a prefix hit by another sequence. A resident layer's new KV is not written
through; its host copy is *stale* (``stale``: host block → [seq_id, index in its table, layer
mask]) until one of those write-backs (``pending_writebacks``: (layer, device block, host block),
copied by ``LayerKV.flush`` before the next forward writes a device block). Invariants (checked by
``check``): a running sequence's offloaded layers are on the host for all its computed tokens; a
stale block has one owner, a running sequence whose layer is resident; a shared block and a
cached free block are never stale (hits and releases write back first).

Accounting invariant (checked by ``check``): every device block is exactly one of free, resident
(in one table) or staging (during a forward), and
``resident + 2 · Σ_{running seqs with r < L} len(block_table) ≤ capacity`` — the staging any step
can need is reserved, so a forward never runs out of device blocks. Admission (``can_allocate``)
needs only the staging of the new sequence to fit after demoting resident layers of others
(``2 · nb ≤ capacity − 2 · Σ nb_running``), where request-level allocation needs ``L · nb``; the
new sequence then keeps as many layers resident as fit. When a decode's new block does not fit,
resident layers are demoted (newest sequence, highest layer first; their stale blocks written back)
before anything is preempted; when room comes back, ``promote`` (before every forward) brings
offloaded layers back (one copy instead of a prefetch per step).
"""

from __future__ import annotations

from arbor.engine.block_manager import BlockManager
from arbor.engine.sequence import Sequence


class DeviceTier:
    """The device pool's accounting: free blocks, per-sequence per-layer tables, staging reserve."""

    def __init__(self, capacity: int, num_layers: int, block_size: int):
        if capacity < 2:
            raise ValueError(f"the device tier needs at least 2 layer-blocks (double-buffered staging), got {capacity}")
        self.capacity, self.num_layers, self.block_size = capacity, num_layers, block_size
        self.free: list[int] = list(range(capacity - 1, -1, -1))     # a stack: pop() gives low ids first
        self.tables: dict[int, list[list[int]]] = {}                  # seq_id → [layer][i] device block
        self.seqs: dict[int, Sequence] = {}                           # seq_id → sequence, admission order
        self.staging: list[int] = []                                  # blocks lent to the forward in flight
        self.reserve = 0                                              # 2 · Σ nb over seqs with r < L
        self.num_demotions = self.num_promotions = 0
        self.pending_fills: list[tuple[int, int, int, int]] = []      # (seq_id, layer, device, host) to copy
        self.stale: dict[int, list[int]] = {}                         # host block → [seq_id, index, layer mask]
        self.pending_writebacks: list[tuple[int, int, int]] = []      # (layer, device, host) to copy

    @property
    def resident(self) -> int:
        return sum(len(t) for tables in self.tables.values() for t in tables)

    @property
    def used(self) -> int:
        """Device blocks in use now: resident plus staging."""
        return self.capacity - len(self.free)

    def budget(self) -> int:
        """Free blocks beyond the staging reserve."""
        return len(self.free) + len(self.staging) - self.reserve

    def resident_layers(self, seq: Sequence) -> int:
        return len(self.tables.get(seq.seq_id, ()))

    def _cost(self, nb: int, r: int) -> int:
        return r * nb + (2 * nb if r < self.num_layers else 0)

    def resident_fit(self, nb: int) -> int:
        """Layers a new sequence of ``nb`` blocks would keep resident in today's budget (no demotions)."""
        r = self.num_layers
        while r and self._cost(nb, r) > self.budget():
            r -= 1
        return r

    def mark_written(self, seq: Sequence, first: int, last: int) -> None:
        """A forward writes blocks ``first .. last`` of ``seq``: the host copies of its resident layers go stale."""
        mask = (1 << len(self.tables[seq.seq_id])) - 1
        for i in range(first, last + 1) if mask else ():
            entry = self.stale.setdefault(seq.block_table[i], [seq.seq_id, i, 0])
            assert entry[:2] == [seq.seq_id, i], "a stale block has one owner"
            entry[2] |= mask

    def _write_back(self, host: int, layers: int) -> None:
        """Queue the copies that make ``host`` current for the layers in the mask ``layers`` (from the
        owner's device blocks) and forget the staleness."""
        entry = self.stale[host]
        owner, i = entry[0], entry[1]
        tables = self.tables[owner]
        self.pending_writebacks += [(a, tables[a][i], host) for a in range(len(tables)) if layers >> a & 1]
        entry[2] &= ~layers
        if not entry[2]:
            del self.stale[host]

    def floor_need(self, extra_blocks: int = 0) -> int:
        """Device blocks the running sequences need with every layer demoted (their staging only)."""
        return 2 * (sum(len(s.block_table) for s in self.seqs.values()) + extra_blocks)

    def admit(self, seq: Sequence) -> None:
        """Register ``seq`` (its host block table set): demote others until its staging fits, then
        keep as many of its layers resident as fit."""
        nb, L = len(seq.block_table), self.num_layers
        for host in seq.block_table[:seq.num_computed_tokens // self.block_size]:
            if host in self.stale:          # a hit on KV only its owner's device blocks hold
                self._write_back(host, self.stale[host][2])
        self.make_room(lambda: 2 * nb)
        r = self.resident_fit(nb)
        self.seqs[seq.seq_id] = seq
        self.tables[seq.seq_id] = [[self.free.pop() for _ in range(nb)] for _ in range(r)]
        if r < L:
            self.reserve += 2 * nb
        if seq.num_computed_tokens:      # prefix-cache hits: copy the hit blocks of resident layers up
            hit = seq.num_computed_tokens // self.block_size
            self.pending_fills += [(seq.seq_id, a, self.tables[seq.seq_id][a][i], seq.block_table[i])
                                   for a in range(r) for i in range(hit)]

    def grow(self, seq: Sequence) -> None:
        """``seq`` is about to get one more host block: give each resident layer a device block (and
        grow its staging reserve when it has offloaded layers). Call before appending to the host table."""
        tables = self.tables[seq.seq_id]
        self.make_room(lambda: len(tables) + (2 if len(tables) < self.num_layers else 0), keep=seq)
        if len(tables) < self.num_layers:
            self.reserve += 2
        for t in tables:
            t.append(self.free.pop())

    def make_room(self, amount, keep: Sequence | None = None) -> None:
        """Demote resident layers (newest sequence first, highest layer first) until
        ``budget() ≥ amount()``; ``keep`` is demoted last."""
        order = [s for s in reversed(self.seqs.values()) if s is not keep] + ([keep] if keep is not None else [])
        for s in order:
            while self.budget() < amount() and self.tables[s.seq_id]:
                self.demote(s)
        if self.budget() < amount():
            raise RuntimeError(f"device tier: {amount()} blocks wanted, {self.budget()} available with every layer "
                               "demoted (the caller must check can_allocate / can_append first)")

    def demote(self, seq: Sequence) -> None:
        """Drop ``seq``'s highest resident layer from the device, writing back its stale blocks first."""
        tables = self.tables[seq.seq_id]
        a = len(tables) - 1
        for host in seq.block_table:
            if host in self.stale and self.stale[host][2] >> a & 1:
                self._write_back(host, 1 << a)
        if len(tables) == self.num_layers:
            self.reserve += 2 * len(seq.block_table)
        self.free += reversed(tables.pop())
        self.pending_fills = [f for f in self.pending_fills if not (f[0] == seq.seq_id and f[1] == len(tables))]
        self.num_demotions += 1

    def promote(self) -> int:
        """Bring offloaded layers back while the budget allows (oldest sequence first, lowest offloaded
        layer first): the layer gets device blocks and its computed blocks are queued as fills (copied
        host → device before the next forward reads them). → layers promoted."""
        done = 0
        for s in self.seqs.values():
            tables, nb = self.tables[s.seq_id], len(s.block_table)
            while len(tables) < self.num_layers:
                last = len(tables) == self.num_layers - 1
                if nb - (2 * nb if last else 0) > self.budget():
                    break
                if last:
                    self.reserve -= 2 * nb
                tables.append([self.free.pop() for _ in range(nb)])
                computed = -(-s.num_computed_tokens // self.block_size)
                self.pending_fills += [(s.seq_id, len(tables) - 1, tables[-1][i], s.block_table[i])
                                       for i in range(computed)]
                done += 1
        self.num_promotions += done
        return done

    def release(self, seq: Sequence, cached=frozenset()) -> None:
        """Give ``seq``'s device blocks back; its stale blocks in ``cached`` (host blocks the prefix cache
        keeps) are written back first, the others are dropped with it."""
        if seq.seq_id not in self.tables:
            return
        for host in seq.block_table:
            if host in self.stale:
                if host in cached:
                    self._write_back(host, self.stale[host][2])
                else:
                    del self.stale[host]
        tables = self.tables.pop(seq.seq_id)
        del self.seqs[seq.seq_id]
        if len(tables) < self.num_layers:
            self.reserve -= 2 * len(seq.block_table)
        for t in tables:
            self.free += reversed(t)
        self.pending_fills = [f for f in self.pending_fills if f[0] != seq.seq_id]

    def take_staging(self, n: int) -> list[int]:
        assert n <= len(self.free), "staging beyond the reserve"
        out = [self.free.pop() for _ in range(n)]
        self.staging += out
        return out

    def return_staging(self) -> None:
        self.free += reversed(self.staging)
        self.staging = []

    def check(self) -> None:
        """AssertionError unless every block is exactly one of free / resident / staging and the reserve holds."""
        owned = [b for tables in self.tables.values() for t in tables for b in t]
        every = owned + self.free + self.staging
        assert len(every) == len(set(every)) == self.capacity, "a device block is owned twice or lost"
        for sid, tables in self.tables.items():
            nb = len(self.seqs[sid].block_table)
            assert all(len(t) == nb for t in tables), "a resident layer table does not cover the host table"
        want = sum(2 * len(s.block_table) for sid, s in self.seqs.items() if len(self.tables[sid]) < self.num_layers)
        assert self.reserve == want, "staging reserve out of date"
        assert len(owned) + self.reserve <= self.capacity, "the staging reserve does not fit"
        for host, (sid, i, mask) in self.stale.items():
            assert sid in self.seqs and self.seqs[sid].block_table[i] == host, "a stale block without its owner"
            assert 0 < mask < 1 << len(self.tables[sid]), "a stale layer that is not resident"


class TieredBlockManager(BlockManager):
    """``BlockManager`` over the host tier plus the ``DeviceTier`` (``tiers.device``) accounting."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, states=None,
                 tiers=None):
        super().__init__(num_blocks, block_size, enable_prefix_caching, states)
        self.tiers = tiers
        self.device: DeviceTier = tiers.device

    def can_allocate(self, seq: Sequence) -> bool:
        nb = self.blocks_needed(len(seq))
        return super().can_allocate(seq) and self.device.floor_need(nb) <= self.device.capacity

    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens of waiting ``seq`` the prefix cache would serve now (what ``allocate`` would hit)."""
        return len(self._lookup(seq)) * self.block_size

    def allocate(self, seq: Sequence) -> None:
        super().allocate(seq)
        self.device.admit(seq)
        self._flush()

    def can_append(self, seq: Sequence) -> bool:
        if len(seq.block_table) >= self.blocks_needed(len(seq)):
            return True
        return super().can_append(seq) and self.device.floor_need(1) <= self.device.capacity

    def append_slot(self, seq: Sequence) -> None:
        if len(seq.block_table) < self.blocks_needed(len(seq)):
            self.device.grow(seq)
            self._flush()
        super().append_slot(seq)

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``; the blocks that stay hittable (canonical holders of their hash) are written back."""
        cached = {b for b in seq.block_table[:len(seq.block_hashes)]
                  if self.hash_to_block.get(self.blocks[b].hash) == b} if self.enable_prefix_caching else ()
        self.device.release(seq, cached)
        self._flush()
        super().deallocate(seq)

    def _flush(self) -> None:
        """Start the queued write-backs now (they overlap scheduling; the next forward waits for them)."""
        if self.device.pending_writebacks:
            self.tiers.flush()
