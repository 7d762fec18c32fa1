"""Expert-parallel token exchange over ``all_to_all_single``: tag-checked counts, differentiable rows.

Dispatch of one MoE layer on an EP group of W ranks, each holding L local experts:

1. ``exchange_counts(counts [W, L], tag)``: row r of ``counts`` is how many token copies this rank
   sends to each local expert slot of rank r. One all-to-all of int64 rows ``[tag (3), counts (L)]``
   delivers every peer's counts for this rank's slots — and its tag, which must equal ours:
   ``tag = (phase, layer, step)``. A peer in another phase, layer or step (a crossed collective)
   raises ``TagMismatchError`` with both tags at once instead of exchanging the wrong rows.
   Costs no collective beyond the counts exchange that uneven splits need anyway.
2. ``all_to_all(x, out_splits, in_splits)``: the rows themselves. Autograd: the backward of an
   all-to-all with splits (in, out) is the all-to-all of the gradient with the splits swapped.
   Uneven and zero-size splits are fine (gloo and NCCL); the list form ``dist.all_to_all`` is
   never used (gloo rejects uneven sizes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PHASES = {"forward": 0, "train": 1, "prefill": 2, "decode": 3, "idle": 4}
PHASE_NAMES = {v: k for k, v in PHASES.items()}


class TagMismatchError(RuntimeError):
    """Two ranks met in one collective from different (phase, layer, step): a crossed collective."""


def _tag_text(tag) -> str:
    phase, layer, step = (int(v) for v in tag)
    return f"(phase {PHASE_NAMES.get(phase, phase)}, layer {layer}, step {step})"


def exchange_counts(ctx, counts: torch.Tensor, tag: tuple[int, int, int], group=None) -> torch.Tensor:
    """counts [W, L] int64 (what this rank sends to each slot of each rank) → [W, L] (what each rank
    sends to this rank's slots). Raises ``TagMismatchError`` when a peer's tag differs."""
    world = counts.shape[0]
    send = torch.cat([torch.tensor(tag, dtype=torch.int64).expand(world, 3), counts.to(torch.int64).cpu()], 1)
    recv = torch.empty_like(send)
    with ctx.guard(f"ep counts {_tag_text(tag)}"):
        ctx.run(lambda: dist.all_to_all_single(recv, send.contiguous(), group=group if group is not None else ctx.ep_group))
    mine = send[0, :3]
    for r in range(world):
        if not torch.equal(recv[r, :3], mine):
            g = ctx.ep_group if group is None else group
            peer = dist.get_global_rank(g, r) if g is not None else r
            raise TagMismatchError(
                f"rank {ctx.rank}: crossed expert-parallel collective: this rank is at {_tag_text(mine)} but "
                f"rank {peer} sent {_tag_text(recv[r, :3])}; every rank must issue its MoE exchanges in one order")
    return recv[:, 3:].to(counts.device)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, out_splits, in_splits, group, ctx):
        fctx.splits, fctx.group, fctx.ctx = (out_splits, in_splits), group, ctx
        return _exchange(x, out_splits, in_splits, group, ctx, "ep rows")

    @staticmethod
    def backward(fctx, grad):
        out_splits, in_splits = fctx.splits
        return _exchange(grad, in_splits, out_splits, fctx.group, fctx.ctx, "ep rows (backward)"), None, None, None, None


def _exchange(x, out_splits, in_splits, group, ctx, name):
    out, x = x.new_empty((sum(out_splits), *x.shape[1:])), x.contiguous()
    with ctx.guard(name):
        ctx.run(lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group))
    return out


def all_to_all(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    """Send ``x``'s rows in chunks of ``in_splits`` (one per rank), receive ``sum(out_splits)`` rows;
    differentiable."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group if group is not None else ctx.ep_group, ctx)
