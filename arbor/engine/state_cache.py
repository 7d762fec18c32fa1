"""One recurrent-state slot per running sequence for the linear-attention (Gated DeltaNet) layers.

Slot s holds, for every linear layer, ``conv [conv_dim, K−1]`` (model dtype) and
``recurrent [Hv, dk, dv]`` (float32): the state after the sequence's ``num_computed_tokens``
tokens. A slot is zeroed when taken (a sequence starts, or restarts after preemption, at
token 0). Prefix caching is off for models with linear layers (no block-boundary states).
"""

from __future__ import annotations

import torch

from arbor.models.gated_deltanet import LinearState


class StateCache:
    def __init__(self, model, num_slots: int, device):
        self.layers = [i for i, layer in enumerate(model.model.layers) if layer.is_linear]
        self.conv, self.recurrent = {}, {}
        rule = torch.promote_types(model.dtype, torch.float32)
        for i in self.layers:
            m = model.model.layers[i].linear_attn
            self.conv[i] = torch.zeros(num_slots, m.conv_dim, m.conv_kernel - 1, dtype=model.dtype, device=device)
            self.recurrent[i] = torch.zeros(num_slots, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=rule, device=device)
        self.free = list(range(num_slots - 1, -1, -1))

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
