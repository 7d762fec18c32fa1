"""Recurrent states of the linear-attention (Gated DeltaNet) layers: one slot per running
sequence, and snapshots at block boundaries for prefix caching.

Slot s holds, for every linear layer, ``conv [conv_dim, K−1]`` (model dtype) and
``recurrent [Hv, dk, dv]`` (float32): the state after the sequence's ``num_computed_tokens``
tokens. A slot is zeroed when taken (a sequence starts, or restarts after preemption, at
token 0) unless it starts from a prefix-cache hit, which restores a snapshot instead.

Snapshots make prefix caching exact for hybrid models: the state after the first ``i·block_size``
tokens is saved under the chain hash of block i (the hash of the whole prefix, see
``BlockManager``), at most ``num_snapshots`` of them, least recently used evicted first. A
prefix hit is only as long as its last block has a snapshot. Invariant: a snapshot is the state
the model computes after exactly that prefix under the current weights (``clear_snapshots``
after a weight update).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from arbor.models.gated_deltanet import LinearState


class StateCache:
    def __init__(self, model, num_slots: int, device, num_snapshots: int = 0):
        self.layers = [i for i, layer in enumerate(model.model.layers) if layer.is_linear]
        self.conv, self.recurrent = {}, {}
        rule = torch.promote_types(model.dtype, torch.float32)
        # rows [0, num_slots) are the running slots, the rest hold snapshots
        self.num_slots, self.num_snapshots = num_slots, num_snapshots if self.layers else 0
        rows = num_slots + self.num_snapshots
        for i in self.layers:
            m = model.model.layers[i].linear_attn
            self.conv[i] = torch.zeros(rows, m.conv_dim, m.conv_kernel - 1, dtype=model.dtype, device=device)
            self.recurrent[i] = torch.zeros(rows, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=rule, device=device)
        self.free = list(range(num_slots - 1, -1, -1))
        self.snapshots: OrderedDict[int, int] = OrderedDict()     # prefix hash → row, oldest use first
        self.free_rows = list(range(rows - 1, num_slots - 1, -1))

    def __bool__(self) -> bool:
        return bool(self.layers)

    def take(self) -> int:
        slot = self.free.pop()
        for i in self.layers:
            self.conv[i][slot].zero_()
            self.recurrent[i][slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def gather(self, slots: torch.Tensor, num_layers: int) -> list[LinearState | None]:
        states = [None] * num_layers
        for i in self.layers:
            states[i] = LinearState(self.conv[i][slots], self.recurrent[i][slots])
        return states

    def scatter(self, slots: torch.Tensor, states: list[LinearState | None]) -> None:
        for i in self.layers:
            self.conv[i][slots] = states[i].conv.to(self.conv[i].dtype)
            self.recurrent[i][slots] = states[i].recurrent.to(self.recurrent[i].dtype)

    # ---- snapshots ------------------------------------------------------------------------
    def has_snapshot(self, key: int) -> bool:
        return key in self.snapshots

    def _copy(self, dst: int, src: int) -> None:
        for i in self.layers:
            self.conv[i][dst] = self.conv[i][src]
            self.recurrent[i][dst] = self.recurrent[i][src]

    def save_snapshot(self, slot: int, key: int) -> None:
        """Keep slot's state under ``key`` (evicting the least recently used snapshot if full)."""
        if not self.num_snapshots:
            return
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        if not self.free_rows:
            _, row = self.snapshots.popitem(last=False)
            self.free_rows.append(row)
        row = self.free_rows.pop()
        self._copy(row, slot)
        self.snapshots[key] = row

    def restore_snapshot(self, slot: int, key: int) -> None:
        row = self.snapshots[key]
        self.snapshots.move_to_end(key)
        self._copy(slot, row)

    def clear_snapshots(self) -> None:
        self.free_rows += self.snapshots.values()
        self.snapshots.clear()
