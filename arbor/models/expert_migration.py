"""State-consistent expert migration: apply a new placement to an expert-parallel model in place.

``migrate_experts(model, ctx, placements, optimizer)`` moves, for every MoE layer whose placement
changes, each expert's state to its new owner and slot: the fused weights (``gate_up_proj[slot]``,
``down_proj[slot]``), their gradients when present and every optimizer-state tensor indexed by slot
(AdamW: ``exp_avg``, ``exp_avg_sq``). Per layer and tensor, one ``all_to_all_single`` over the EP
group carries the experts that change rank (rows ordered by destination rank, then logical id;
every rank derives both split vectors from the two placements, so no count exchange is needed);
experts that stay on their rank are permuted locally. Results are copied INTO the existing
Parameter and state tensors, so the optimizer's parameter list and state keys stay valid. Then
``Experts.expert_ids`` and each layer's ``EPDispatch`` placement are updated.

Invariants: logical routing is untouched (the router and replayed ids name logical experts), so a
forward after migration computes what it computed before: each expert's rows reach it in the same
order, and a token's top-2 contributions are added in either order with the same float result
(addition of two terms commutes) — float32 outputs, gradients and the next AdamW step are
bit-identical for top-k ≤ 2 (tests/test_routepack_migration.py); for k > 2 they agree to rounding.
A scalar optimizer ``step`` is per parameter tensor; it must be equal on every EP rank (lockstep
training guarantees it), else migration refuses. Collective: every rank of every EP group calls it
with the same placements, between optimizer steps.

``set_placement(model, placements)`` only relabels (no data moves): for a model whose tensors are
about to be overwritten by name (a checkpoint load, the engine's copy before ``update_weights``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from arbor.models.expert_parallel import ExpertPlacement, moe_modules


def placements_of(model) -> dict[int, ExpertPlacement]:
    """MoE-layer index → its current placement (empty for a model without EP)."""
    if getattr(model, "ep_state", None) is None:
        return {}
    return {m: moe.dispatch.placement for m, moe in enumerate(moe_modules(model))}


def as_placements(raw) -> dict[int, ExpertPlacement]:
    """{layer: ExpertPlacement | (rank_of, slot_of, ep_size) | {"rank_of", "slot_of", "ep_size"}} → placements."""
    out = {}
    for m, p in raw.items():
        if isinstance(p, dict):
            p = ExpertPlacement(list(p["rank_of"]), list(p["slot_of"]), int(p["ep_size"]))
        elif not isinstance(p, ExpertPlacement):
            p = ExpertPlacement(list(p[0]), list(p[1]), int(p[2]))
        out[int(m)] = p
    return out


def set_placement(model, placements) -> None:
    """Relabel the model's experts and dispatchers to ``placements`` without moving any data."""
    placements = as_placements(placements)
    for m, moe in enumerate(moe_modules(model)):
        if m in placements:
            _relabel(moe, placements[m], moe.dispatch.ctx.ep_rank)


def _relabel(moe, new: ExpertPlacement, rank: int) -> None:
    old = moe.dispatch.placement
    if new.ep_size != old.ep_size or len(new.rank_of) != len(old.rank_of):
        raise ValueError(f"placement for {len(new.rank_of)} experts on {new.ep_size} ranks does not fit "
                         f"{len(old.rank_of)} experts on {old.ep_size}")
    moe.experts.expert_ids = new.experts_of(rank)
    moe.dispatch.placement = new
    moe.dispatch.rank_of = torch.tensor(new.rank_of)
    moe.dispatch.slot_of = torch.tensor(new.slot_of)


def _slot_tensors(param: torch.nn.Parameter, optimizer) -> list[torch.Tensor]:
    """The tensors indexed by expert slot that belong to ``param``: itself, its grad, its state."""
    out = [param.data]
    if param.grad is not None:
        out.append(param.grad)
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    for k in sorted(state):
        v = state[k]
        if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == param.shape[0]:
            out.append(v)
    return out


def _steps(params, optimizer) -> list[float]:
    if optimizer is None:
        return []
    return [float(optimizer.state.get(p, {}).get("step", -1)) for p in params]


@torch.no_grad()
def migrate_experts(model, ctx, placements, optimizer=None) -> dict:
    """Apply ``placements`` (see module docstring). → {"moved": experts that changed rank (all layers),
    "bytes_sent": bytes this rank sent, "layers": layers changed}."""
    placements = as_placements(placements)
    if getattr(model, "ep_state", None) is None:
        raise ValueError("migrate_experts needs a model sharded with shard_experts (ep_size > 1)")
    mods = moe_modules(model)
    changed = [m for m in sorted(placements) if placements[m].rank_of != mods[m].dispatch.placement.rank_of
               or placements[m].slot_of != mods[m].dispatch.placement.slot_of]
    params = [p for m in changed for p in (mods[m].experts.gate_up_proj, mods[m].experts.down_proj)]
    mine = (_steps(params, optimizer), [len(_slot_tensors(p, optimizer)) for p in params])
    everyone = ctx.all_gather_object(mine, "migrate experts: optimizer steps")
    if any(p != mine for p in everyone):
        raise ValueError(f"rank {ctx.rank}: expert migration needs every rank at the same optimizer step with "
                         f"the same state tensors; got (steps, tensors per parameter) {everyone}")
    moved, sent = 0, 0
    for m in changed:
        moe, new = mods[m], placements[m]
        old, rank, W = moe.dispatch.placement, ctx.ep_rank, new.ep_size
        leaving = sorted((new.rank_of[e], e) for e in moe.experts.expert_ids if new.rank_of[e] != rank)
        arriving = sorted((old.rank_of[e], e) for e in new.experts_of(rank) if old.rank_of[e] != rank)
        send_splits = [sum(1 for r, _ in leaving if r == d) for d in range(W)]
        recv_splits = [sum(1 for r, _ in arriving if r == s) for s in range(W)]
        send_slots = torch.tensor([old.slot_of[e] for _, e in leaving], dtype=torch.long)
        source = {e: ("local", old.slot_of[e]) for e in new.experts_of(rank) if old.rank_of[e] == rank}
        source.update({e: ("recv", j) for j, (_, e) in enumerate(arriving)})
        for param in (moe.experts.gate_up_proj, moe.experts.down_proj):
            for t in _slot_tensors(param, optimizer):
                out = t.new_empty((sum(recv_splits), *t.shape[1:]))
                payload = t[send_slots.to(t.device)].contiguous()
                with ctx.guard(f"migrate experts (MoE layer {m})"):
                    dist.all_to_all_single(out, payload, recv_splits, send_splits, group=ctx.ep_group)
                sent += payload.numel() * payload.element_size()
                rows = [t[slot] if where == "local" else out[slot] for where, slot in
                        (source[e] for e in new.experts_of(rank))]
                t.copy_(torch.stack(rows))
        moved += len(leaving)
        _relabel(moe, new, rank)
    return {"moved": int(ctx.sum_floats([moved], "migrate experts: count")[0]) if ctx.distributed else moved,
            "bytes_sent": sent, "layers": changed}
