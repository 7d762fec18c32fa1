"""Expert parallelism (EP): each MoE layer's experts split over the ranks of an EP group.

A placement map per layer says where each logical expert lives: ``rank_of[e]`` (EP rank) and
``slot_of[e]`` (its index among that rank's local experts); every rank holds ``E / ep_size``
experts. The default is contiguous (rank r holds experts r·L … r·L + L − 1, L = E / ep_size); any
other balanced map can be given per layer.

``shard_experts(model, ctx)`` keeps only the rank's own expert weights in each ``Experts`` module
(``expert_ids`` lists the logical ids of its slots) and replaces the layer's ``dispatch`` with an
``EPDispatch``. Routing (router, top-k, replayed ids, router probabilities) is unchanged and
computed where the token lives, so routing replay, per-expert counts and the load-balancing loss
work as in one process. Dispatch of a layer (x [T, D], ids/weights [T, k]):

    sort the T·k copies by (destination rank, slot) → exchange counts (tag-checked) →
    all-to-all rows → each local expert on its rows → all-to-all back → y_t = Σ_j w_tj · row

which equals ``dispatch_experts`` up to float summation order (tests: float32 ≤ 1e-5). Every rank
must dispatch every MoE layer of every forward in one order; a rank with no tokens calls
``idle_forward`` (zero rows through every layer, and the reverse in backward).

Tag of a dispatch: (phase, MoE-layer index, step); step counts this rank's dispatches of its first
MoE layer, phase is ``train`` under autograd and ``ep_phase`` of the model otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from torch import nn

from arbor.distributed.all_to_all import PHASES, all_to_all, exchange_counts
from arbor.models.layers import recomputed
from arbor.models.moe import Experts
from arbor.models.rows import take_rows


@dataclass
class ExpertPlacement:
    rank_of: list[int]
    slot_of: list[int]
    ep_size: int

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> "ExpertPlacement":
        local = num_experts // ep_size
        return cls([e // local for e in range(num_experts)], [e % local for e in range(num_experts)], ep_size)

    def __post_init__(self):
        num = len(self.rank_of)
        if self.ep_size < 1 or num % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} does not divide the {num} experts")
        local = num // self.ep_size
        seen = sorted(zip(self.rank_of, self.slot_of))
        want = [(r, s) for r in range(self.ep_size) for s in range(local)]
        if len(self.slot_of) != num or seen != want:
            raise ValueError(f"an expert placement must give each of the {self.ep_size} ranks exactly {local} "
                             f"experts in slots 0..{local - 1}; got rank_of={self.rank_of}, slot_of={self.slot_of}")

    @property
    def num_local(self) -> int:
        return len(self.rank_of) // self.ep_size

    def experts_of(self, rank: int) -> list[int]:
        """Logical expert ids of ``rank``'s slots, in slot order."""
        mine = [(s, e) for e, (r, s) in enumerate(zip(self.rank_of, self.slot_of)) if r == rank]
        return [e for _, e in sorted(mine)]


class EPState:
    """Shared by a model's EP dispatchers: the phase of the calling thread (``ep_phase``; "forward"
    by default) and a step counter per phase (shared by all threads), so that a prefill executor
    and a decode executor of one rank tag their exchanges independently and as every rank does."""
    def __init__(self):
        self._local = threading.local()
        self.steps: dict[str, int] = {}

    @property
    def phase(self) -> str:
        return getattr(self._local, "phase", "forward")

    @phase.setter
    def phase(self, value: str) -> None:
        self._local.phase = value

    def __deepcopy__(self, memo):   # a copied model (e.g. the engine's bf16 copy) shares the counter
        return self


class EPDispatch:
    """Replaces ``dispatch_experts`` for one MoE layer (see module docstring)."""

    def __init__(self, ctx, layer: int, placement: ExpertPlacement, state: EPState):
        self.ctx, self.layer, self.placement, self.state = ctx, layer, placement, state
        self.rank_of = torch.tensor(placement.rank_of)
        self.slot_of = torch.tensor(placement.slot_of)

    def __deepcopy__(self, memo):   # process groups are not copied: a model copy joins the same ones
        return EPDispatch(self.ctx, self.layer, self.placement, self.state)

    def tag(self, grad: bool) -> tuple[int, int, int]:
        phase = "train" if grad else self.state.phase
        if self.layer == 0:
            self.state.steps[phase] = self.state.steps.get(phase, 0) + 1
        return PHASES[phase], self.layer, self.state.steps.get(phase, 0)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts) -> torch.Tensor:
        W, L, k = self.placement.ep_size, self.placement.num_local, ids.shape[1]
        flat = ids.reshape(-1).cpu()
        key = self.rank_of[flat] * L + self.slot_of[flat]
        order = key.argsort(stable=True)
        counts = torch.bincount(key, minlength=W * L).view(W, L)
        grad = torch.is_grad_enabled() and x.requires_grad
        group = self.ctx.ep_group_for("train" if grad else self.state.phase)
        recv_counts = exchange_counts(self.ctx, counts, self.tag(grad), group)
        send_splits, recv_splits = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        order, token = order.to(x.device), (order // k).to(x.device)
        rows = all_to_all(self.ctx, take_rows(x, token), recv_splits, send_splits, group)
        # rows arrive grouped by (source rank, slot); regroup by slot for one matmul per expert
        slot = torch.arange(L).repeat(W).repeat_interleave(recv_counts.reshape(-1)).to(x.device)
        by_slot = slot.argsort(stable=True)
        out = experts.grouped(list(rows[by_slot].split(recv_counts.sum(0).tolist())))
        y_rows = out[by_slot.argsort()] if out is not None else rows
        back = all_to_all(self.ctx, y_rows, send_splits, recv_splits, group)
        y = back * weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


@contextlib.contextmanager
def ep_phase(model, phase: str):
    """Tag (and, with private groups, route) this thread's MoE exchanges as ``phase``."""
    state = getattr(model, "ep_state", None)
    if state is None:
        yield
        return
    before, state.phase = state.phase, phase
    try:
        yield
    finally:
        state.phase = before


def moe_modules(model) -> list:
    return [layer.mlp for layer in model.model.layers if layer.is_moe]


def shard_experts(model, ctx, placements: dict[int, ExpertPlacement] | None = None) -> None:
    """Keep rank ``ctx.ep_rank``'s experts in every MoE layer (in place; works on a meta model) and
    dispatch through the EP group. ``placements``: MoE-layer index → placement (default contiguous)."""
    if ctx.ep_size <= 1:
        return
    if getattr(model, "ep_state", None) is not None:
        raise ValueError("the model is already sharded over an expert-parallel group")
    E = model.config.num_experts
    state = EPState()
    for m, moe in enumerate(moe_modules(model)):
        placement = (placements or {}).get(m) or ExpertPlacement.contiguous(E, ctx.ep_size)
        if placement.ep_size != ctx.ep_size or len(placement.rank_of) != E:
            raise ValueError(f"MoE layer {m}: placement for {len(placement.rank_of)} experts on "
                             f"{placement.ep_size} ranks does not fit {E} experts on ep_size {ctx.ep_size}")
        mine = placement.experts_of(ctx.ep_rank)
        old = moe.experts
        with torch.device("meta"):      # no allocation, no draw from the random generator
            new = Experts(len(mine), old.gate_up_proj.shape[2], old.down_proj.shape[2])
        with torch.no_grad():
            index = torch.tensor(mine)
            new.gate_up_proj = nn.Parameter(old.gate_up_proj.detach()[index].clone())
            new.down_proj = nn.Parameter(old.down_proj.detach()[index].clone())
        new.expert_ids = mine
        moe.experts = new
        moe.dispatch = EPDispatch(ctx, m, placement, state)
    model.ep_state = state


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def idle_forward(model) -> torch.Tensor | None:
    """A rank with no tokens joins the MoE exchanges of one forward (and, under autograd, of its
    backward): zero rows through every MoE layer in order. → a 0-valued scalar to add to the loss,
    or None for a model without EP."""
    if getattr(model, "ep_state", None) is None:
        return None
    return list(idle_segments(model, len(model.model.layers)))[-1][1].sum()


def idle_segments(model, layers_per_segment: int):
    """``idle_forward`` cut at ``CausalLM.forward_segments``' boundaries: yields ``(layers done, None)``
    after every segment but the last, whose MoE exchanges are then all issued, and finally
    ``(num_layers, zero rows)``. Nothing to exchange (no EP): the same boundaries, no collectives."""
    D = model.config.hidden_size
    x = torch.zeros(0, D, device=model.device, dtype=model.dtype, requires_grad=torch.is_grad_enabled())
    ep = getattr(model, "ep_state", None) is not None
    recompute = model.gradient_checkpointing and torch.is_grad_enabled()
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if ep and layer.is_moe:
            moe, k = layer.mlp, layer.mlp.top_k
            ids = torch.zeros(0, k, dtype=torch.long, device=model.device)
            dispatch = lambda x, moe=moe, ids=ids: moe.dispatch(x, ids, x.new_zeros(0, k), moe.experts)
            x = x + (recomputed(dispatch, x) if recompute else dispatch(x))
        if (i + 1) % layers_per_segment == 0 and i + 1 < len(layers):
            yield i + 1, None
    yield len(layers), x
