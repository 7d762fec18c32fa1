"""Data-parallel + expert-parallel training on the ranks of a ``DistContext``.

Split of work: a step's micro-batches are assigned to ranks by ``assign_lpt`` on their compact-token
work (each rank its share), and every rank runs the same number of forward/backward passes — a rank
short of micro-batches runs idle passes (``run_idle_passes``: ``idle_forward`` under EP, so its expert
exchanges line up with the others'; a whole one-token pass under FSDP, ``arbor.train.fsdp.idle_pass``).

Gradients: the loss of every micro-batch is already normalised by the *global* step's size (tokens
or samples of all ranks), so the full gradient is the SUM over ranks:
- non-expert parameters (replicated): one flat all-reduce (SUM) over all ranks; with ``dist.fsdp``
  they are sharded DTensors instead, reduce-scattered (SUM) by FSDP2 itself in backward, and skipped here;
- expert parameters: each expert's gradient is complete on its owner (the all-to-all backward brings
  every rank's contribution), so it is only summed over the replica group of ranks holding the same
  experts (world / ep_size of them; none when ep_size = world). FSDP never shards them under EP.
Clipping uses the global norm ‖g‖² = Σ_replicated ‖g_p‖² + Σ_ranks Σ_own shards ‖g_p‖² + Σ_EP ranks
Σ_own experts ‖g_p‖², so every rank clips by the same factor and AdamW keeps replicated parameters
identical on all ranks (and each shard consistent with the others).

Without ``dist.fsdp`` this is written by hand rather than with DDP: DDP averages (we need the sum of
globally normalised losses), wants identical parameter sets on every rank (expert shards differ) and
issues its reductions from backward hooks, which would interleave with the EP all-to-alls of the
backward. What remains is one flat all-reduce per step. With ``dist.fsdp`` (``arbor.train.fsdp``)
FSDP2 holds 1/W of each replicated parameter, gradient and AdamW moment per rank, set to sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from arbor.models.expert_parallel import idle_forward, is_expert_param
from arbor.train.fsdp import idle_pass, is_fsdp, is_sharded, sharded_sq_norm
from arbor.train.tree_plan import assign_lpt


def set_recompute(model, on: bool) -> None:
    """Activation recomputation (``train.recompute``). Under expert parallelism a recomputed layer issues
    its forward exchanges again inside backward; an idle rank's passes recompute their exchanges the same
    way (``arbor.models.expert_parallel.idle_segments``), so every rank's backward exchanges alike."""
    model.gradient_checkpointing = on


def my_share(work: list[int], ctx) -> list[int]:
    """Indices of the items (micro-batches) this rank runs: LPT over ranks by work; same on every rank."""
    if not ctx.distributed:
        return list(range(len(work)))
    return sorted(assign_lpt(work, ctx.world_size)[ctx.rank])


def global_count(n: int, ctx, op: str = "max", name: str = "micro-batch count") -> int:
    """max (or sum) of an integer over ranks."""
    if not ctx.distributed:
        return n
    return int(ctx.all_reduce(torch.tensor([n], dtype=torch.int64), op, name, ctx.control)[0])


def run_idle_passes(model, count: int) -> None:
    """``count`` forward+backward passes with no tokens (joins the other ranks' expert exchanges), or
    under FSDP of one zero-weighted token (joins every unit's all-gather and reduce-scatter)."""
    if is_fsdp(model):
        for _ in range(count):
            idle_pass(model)
        return
    for _ in range(count):
        z = idle_forward(model)
        if z is None:
            return
        if torch.is_grad_enabled():
            z.backward()


def _grads(model, expert: bool) -> list[torch.Tensor]:
    """Gradients Arbor reduces itself: every trainable parameter of the kind, but FSDP's (sharded) ones."""
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and is_expert_param(name) == expert and not is_sharded(p):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
    return out


def _sum_flat(grads: list[torch.Tensor], ctx, group, name: str) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with ctx.guard(name):
        dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def reduce_gradients(model, ctx) -> None:
    """Sum gradients over ranks (see module docstring). No-op on one rank."""
    if not ctx.distributed:
        return
    if ctx.ep_size == 1:                   # every parameter replicated, experts included
        _sum_flat(_grads(model, expert=False) + _grads(model, expert=True), ctx, None, "all-reduce gradients")
        return
    _sum_flat(_grads(model, expert=False), ctx, None, "all-reduce gradients")
    if ctx.world_size > ctx.ep_size:
        _sum_flat(_grads(model, expert=True), ctx, ctx.replica_group, "all-reduce expert gradients")


def clip_global(model, max_norm: float, ctx) -> float:
    """Clip every gradient by the norm of all of them over every rank (``clip_grad_norm_``'s rule:
    factor min(1, max_norm / (‖g‖ + 1e-6))); → ‖g‖ before clipping."""
    shared, own, sharded = [], [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            kind = sharded if is_sharded(p.grad) else own if ctx.ep_size > 1 and is_expert_param(name) else shared
            kind.append(p.grad)
    wide = lambda g: g.detach().to(torch.promote_types(g.dtype, torch.float32))    # float64 grads stay float64
    sq = lambda gs: torch.stack([wide(g).norm() for g in gs]).square().sum() if gs else torch.zeros(())
    own_sq = ctx.all_reduce(sq(own).double().reshape(1), "sum", "gradient norm", ctx.ep_group)[0] if own else 0.0
    shard_sq = 0.0
    if ctx.fsdp:               # every rank holds sharded gradients (or none, on every rank)
        shard_sq = ctx.all_reduce(sharded_sq_norm(sharded).reshape(1), "sum", "sharded gradient norm",
                                  ctx.fsdp_group)[0]
    total = (sq(shared).double() + own_sq + shard_sq).sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for g in shared + own + sharded:
            g.mul_(coef)
    return float(total)
