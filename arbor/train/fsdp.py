"""Sharded data parallelism (``dist.fsdp=true``): PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``)
splits every replicated parameter, its gradient and its AdamW moments over the ranks; expert parameters of
an expert-parallel model (``dist.ep_size`` > 1) are left out of FSDP and stay whole with their EP owner.

Layout (``shard_model``): one FSDP unit per decoder layer and one root unit (embeddings, final norm and
``lm_head``, tied or not), over a process group of all ranks of their own (``ctx.fsdp_group``). A sharded
parameter is a DTensor (``Shard(0)``, rank r holds rows ⌈n/W⌉·r …); a unit is all-gathered before its
forward and its gradient reduce-scattered after its backward. The root stays gathered from its forward to
the end of the backward, so ``model.logits(hidden)`` after a forward issues no collective (however many
row chunks a rank has).

Invariants:
- gradients are SUMMED over ranks (divide factor 1, sum-only reductions): Arbor normalises every loss
  by the global step's size, so the sum over ranks is the gradient (``arbor.train.distributed``);
  sharded gradients accumulate over a step's micro-batches like plain ones;
- every rank runs the same number of forward+backward passes per step, each through every unit (FSDP's
  all-gathers and reduce-scatters are per unit and per pass): a rank short of micro-batches runs
  ``idle_pass`` — one token, loss × 0, so zero gradients and the same collectives (and, under EP, the
  same expert exchanges);
- every parameter of a unit gets a gradient on every rank (``set_reduce_scatter_unused_params``), so the
  reduce-scatters have one size on all ranks even where a pass leaves a parameter unused;
- checkpoints (``arbor.train.checkpoint``) hold the model as full tensors (``full_hf_tensors``: one HF
  folder written by rank 0) and each rank's optimizer shard as plain local tensors
  (``local_optimizer_state``), rewrapped on load (``sharded_optimizer_state``) at the same world size.

Scope: ``arbor sft`` and ``arbor train`` (dense and MoE, with or without expert parallelism). In
``arbor train`` the colocated engine serves a plain copy of its own (never the shards), refreshed at each
sync from ``full_tensors`` one gathered tensor at a time; the frozen KL reference is a plain copy made
before sharding. Refused with ``refuse``'s message (exit 2 from the CLI): LoRA (only the adapters train;
their state is small), and one rank (``init_distributed``: "needs ≥ 2 ranks").
"""

from __future__ import annotations

import sys

import torch

from arbor.models import VarlenAttention
from arbor.models.expert_parallel import is_expert_param


def refuse(what: str) -> ValueError:
    """The error of a job that cannot run with ``dist.fsdp=true``."""
    return ValueError(f"dist.fsdp=true is not supported here: {what}; set dist.fsdp=false")


def is_fsdp(model) -> bool:
    """``model`` was sharded by ``shard_model``. (A run that never imported FSDP has no FSDP module, so
    these checks cost no import: ~0.5 s of torch.distributed.tensor.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_sharded(t) -> bool:
    """``t`` is a DTensor (a sharded parameter, its gradient or its moments)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)


def shard_model(model, ctx) -> None:
    """Apply FSDP2 to ``model`` in place (module docstring); after ``shard_experts``, before the optimizer
    is made. Every rank calls it with the same model structure."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from arbor.models.lora import has_lora
    if has_lora(model):
        raise refuse("with LoRA (lora.rank > 0) only the adapters train, and their optimizer state is small")
    mesh = DeviceMesh.from_group(ctx.fsdp_group, ctx.device.type)
    ignored = {p for n, p in model.named_parameters() if ctx.ep_size > 1 and is_expert_param(n)} or None
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)           # a SUM, not FSDP's default mean over ranks
            m.set_force_sum_reduction_for_comms(True)   # plain SUM collectives (gloo has no PREMUL_SUM)
            m.set_reduce_scatter_unused_params(True, recurse=False)


def idle_pass(model) -> None:
    """One forward+backward of one token with its loss × 0: joins every unit's all-gather and
    reduce-scatter (and every expert exchange) of a pass, adding zero to every gradient."""
    ids = torch.zeros(1, dtype=torch.long, device=model.device)
    out = model(ids, VarlenAttention.from_lengths([1], device=model.device))
    z = model.logits(out.hidden).sum() * 0.0
    if torch.is_grad_enabled():
        z.backward()


def sharded_sq_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ ‖local shard‖² of DTensor gradients (float64): summed over ranks it is Σ ‖g‖² of the full ones."""
    wide = lambda g: g.to(torch.promote_types(g.dtype, torch.float32))
    return sum((wide(g.to_local()).norm().double().square() for g in grads), torch.zeros((), dtype=torch.float64))


def full_tensors(model):
    """(name, whole tensor) of every state-dict entry of a sharded ``model``, in state-dict order (the same
    on every rank), each sharded one all-gathered as it is reached: a weight sync holds one gathered tensor
    at a time. Collective: every rank must consume the whole iterator."""
    for name, t in model.state_dict().items():
        yield name, t.full_tensor() if is_sharded(t) else t


class _FullView:
    """What ``to_hf_tensors`` reads of a model (config, state dict, submodules), with full tensors."""
    def __init__(self, model, state: dict):
        self.config, self._model, self._state = model.config, model, state

    def state_dict(self) -> dict:
        return self._state

    def get_submodule(self, name: str):
        return self._model.get_submodule(name)


def full_hf_tensors(model, ctx) -> dict[str, torch.Tensor]:
    """The whole model's HF-named tensors on every rank: sharded parameters all-gathered (in state-dict
    order, the same on every rank) and, under EP, every rank's experts. Collective."""
    from arbor.models.checkpoint import gather_hf_tensors
    with ctx.guard("gather sharded weights"):
        state = {k: (v.full_tensor() if is_sharded(v) else v).detach().cpu() for k, v in model.state_dict().items()}
    return gather_hf_tensors(_FullView(model, state), ctx)


@torch.no_grad()
def load_full_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) Arbor state dict into a sharded model: each rank copies its own rows."""
    from torch.distributed.tensor import distribute_tensor
    names = list(model.state_dict())            # what load_state_dict would load (persistent buffers included)
    missing = sorted(set(names) - weights.keys())
    if missing:
        raise ValueError(f"missing tensor(s) {', '.join(missing[:3])} for the sharded model")
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for name in names:
        p = params[name]
        full = weights[name].to(device=p.device, dtype=p.dtype)
        if is_sharded(p):
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))
        else:
            p.copy_(full)


def local_optimizer_state(state: dict) -> dict:
    """An optimizer ``state_dict()`` with every DTensor replaced by this rank's local shard (picklable)."""
    return {**state, "state": {i: {k: v.to_local().clone() if is_sharded(v) else v for k, v in s.items()}
                               for i, s in state["state"].items()}}


def sharded_optimizer_state(state: dict, optimizer) -> dict:
    """``local_optimizer_state``'s inverse for ``optimizer``: each shard of a parameter's moments becomes a
    DTensor laid out as that parameter (same world size: each rank loads its own shards)."""
    from torch.distributed.tensor import DTensor
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {}
    for i, s in state["state"].items():
        p = params[i]
        out[i] = {k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                  if is_sharded(p) and isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in s.items()}
    return {**state, "state": out}


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of this rank's optimizer state (moments and steps; a DTensor counts its local shard)."""
    total = 0
    for s in optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if is_sharded(v) else v
                total += t.numel() * t.element_size()
    return total
