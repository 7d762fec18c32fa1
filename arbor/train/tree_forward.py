"""One forward over a tree row → exact per-token log-probs of every trajectory.

Log-prob of compact token i: ``logp[i] = log softmax(lm_head(h[parent[i]]))[token_i]`` (0 at a
root, which has no prediction) — the same number as log π(x_t | x_<t) at that token in every
trajectory through i, because i's hidden state depends only on i and its ancestors. Per
trajectory j: ``logp_j = logp[traj_index[j]]`` (autograd sums a shared token's gradient over the
trajectories through it), so any RL loss written for per-trajectory tensors applies unchanged.

Per-token-weights form: for a loss Σ_j Σ_t w_jt · logp_jt, the compact weights are
``W[i] = Σ_{j,t: traj_index[j][t] = i} w_jt`` and Σ_i W[i]·logp[i] is the same loss (with
w_jt = w it is w · multiplicity[i]).

Softmax layers use ``arbor.models.SegmentTreeAttention`` (ancestors + self per fork-free run, cost
Σ_i depth(i) instead of the [T, T] dense mask); linear-attention layers run level by level through
the same segments (``tree_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arbor.models import TreeAttention, expert_counts
from arbor.models.tree_attention import SegmentTreeAttention
from arbor.models.rows import take_rows
from arbor.train.logprobs import gather_logprobs, packed_logprobs
from arbor.train.losses import router_aux_loss
from arbor.plan.packing import first_fit_decreasing
from arbor.train.tree_batch import TreeBatch, TreeConfig, build_rows


def row_attention(row: TreeBatch, cfg: TreeConfig):
    parents = row.parents
    if cfg.attention == "dense":
        attn = TreeAttention(parents)
        attn.linear_replay = cfg.replay
        return attn
    return SegmentTreeAttention(parents, linear_replay=cfg.replay)


@dataclass
class RowOutput:
    logp: torch.Tensor                   # [T] compact per-token log-probs, float32
    per_trajectory: list[torch.Tensor]   # aligned with row.traj_ids, each [L_j]
    routed_experts: torch.Tensor | None  # [num_moe_layers, T, k] when asked
    aux: torch.Tensor | None = None      # MoE load-balancing loss (semantic multiplicities) when asked


def row_logprobs(model, row: TreeBatch, cfg: TreeConfig = TreeConfig(), replay_routing: bool = True,
                 return_routing: bool = False, with_aux: bool = False, spec=None,
                 entropy: list | None = None) -> RowOutput:
    """Forward one tree row. replay_routing: force the row's recorded expert ids if it has any.
    with_aux: also the row's ``router_aux_loss``, each compact token counted multiplicity times.
    spec, entropy: as in ``logprobs.gather_logprobs`` (entropy per compact token)."""
    row = row.to(model.device)
    attn = row_attention(row, cfg)
    routed = row.routed_experts if replay_routing else None
    out = model(row.tokens, attn, positions=row.positions, routed_experts=routed, return_routing=return_routing,
                return_router_probs=with_aux)
    logp = gather_logprobs(model, take_rows(out.hidden, row.parents.clamp(min=0)), row.tokens, spec=spec, entropy=entropy)
    logp = torch.where(row.parents >= 0, logp, torch.zeros_like(logp))
    aux = router_aux_loss(out.router_probs, out.routed_experts, row.multiplicity) if with_aux else None
    return RowOutput(logp, [logp[idx] for idx in row.traj_index], out.routed_experts, aux)


def tree_logprobs(model, rows: list[TreeBatch], num_trajectories: int, cfg: TreeConfig = TreeConfig()) -> list[torch.Tensor]:
    """Per-trajectory log-probs [L_j] of every trajectory (global order) from tree rows."""
    out: list[torch.Tensor | None] = [None] * num_trajectories
    for row in rows:
        for j, lp in zip(row.traj_ids, row_logprobs(model, row, cfg).per_trajectory):
            out[j] = lp
    return out


def trajectory_logprobs(model, trajectories: list[list[int]], token_cap: int = 8192,
                        routed: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Trajectory-wise reference: packed (VarlenAttention) micro-batches of ≤ token_cap tokens."""
    out: list[torch.Tensor | None] = [None] * len(trajectories)
    for micro in first_fit_decreasing([len(t) for t in trajectories], token_cap):
        rr = None if routed is None else torch.cat([routed[i] for i in micro], 1).to(model.device)
        logp, cu = packed_logprobs(model, [trajectories[i] for i in micro], routed_experts=rr)
        for i, lp in zip(micro, logp.split(cu.diff().tolist())):
            out[i] = lp
    return out


def batch_logprobs(model, groups: list[list[list[int]]], cfg: TreeConfig = TreeConfig()) -> list[torch.Tensor]:
    """Per-trajectory log-probs of all groups' trajectories (global order): one forward per tree
    row when ``cfg.enabled``, else trajectory-wise. The two agree to float rounding."""
    if not cfg.enabled:
        return trajectory_logprobs(model, [t for g in groups for t in g], cfg.token_cap)
    rows, n = build_rows(groups, cfg.token_cap)
    return tree_logprobs(model, rows, n, cfg)


def tree_packed_logprobs(model, seqs: list[list[int]], device=None, routed_experts=None,
                         cfg: TreeConfig = TreeConfig(), with_aux: bool = False, spec=None,
                         entropy: list | None = None):
    """Drop-in for ``logprobs.packed_logprobs`` computed on one prefix tree of all ``seqs``:
    → (logp [Σ L_j] float32 in sequence order, 0 at each first token; cu_seqlens [N+1]), and the
    MoE load-balancing loss with ``with_aux`` (equal to the trajectory-wise one).
    routed_experts: [num_moe_layers, Σ L_j, k] in the same packed order, replayed. The forward
    runs where the model lives (``device`` is accepted for the same signature)."""
    lengths = [len(s) for s in seqs]
    routed = None
    if routed_experts is not None:
        routed = [list(routed_experts.split(lengths, dim=1))]
    (row,), _ = build_rows([seqs], cfg.token_cap, routed)  # one group: one tree, one row
    compact = [] if entropy is not None else None
    out = row_logprobs(model, row, cfg, with_aux=with_aux, spec=spec, entropy=compact)
    if entropy is not None:     # one tensor aligned with the returned log-probs, as packed_logprobs leaves
        ent = torch.cat(compact)
        entropy[:] = [torch.cat([ent[idx.to(ent.device)] for idx in row.traj_index])]
    cu = torch.tensor([0] + lengths, device=out.logp.device).cumsum(0)
    return (torch.cat(out.per_trajectory), cu) + ((out.aux,) if with_aux else ())


def compact_weights(row: TreeBatch, weights: list[torch.Tensor]) -> torch.Tensor:
    """Per-trajectory token weights (aligned with row.traj_ids) → compact weights W [T]:
    W[i] = Σ of the weights of i over the trajectories through it; float32 (float64 for float64 weights)."""
    dtype = torch.promote_types(weights[0].dtype, torch.float32) if weights else torch.float32
    out = torch.zeros(row.num_tokens, dtype=dtype, device=row.tokens.device)
    for idx, w in zip(row.traj_index, weights):
        out.index_add_(0, idx.to(out.device), w.to(out))
    return out


def row_expert_counts(routed: torch.Tensor, row: TreeBatch, num_experts: int) -> torch.Tensor:
    """Semantic expert load [num_moe_layers, E]: each compact token counts multiplicity times,
    as trajectory-wise training counts it. Computed from the ids a forward returned, once per
    forward, so recomputation (which re-runs the router) never counts twice."""
    return expert_counts(routed, num_experts, row.multiplicity.to(routed.device))
