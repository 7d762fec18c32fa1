"""Tree mode for linear-attention layers: one packed Gated DeltaNet call per segment level.

A token tree (``parents[i] < i``, −1 = root) is cut into *segments*: maximal runs of tokens
i, i+1, … where each token's only child is the next token. Token i starts a segment iff it is a
root, or ``parents[i] != i − 1``, or its parent has several children; hence a segment's first
token hangs off the *last* token of its parent segment (the fork point), and segments at the
same depth of the segment tree are independent given their parents' states.

Chunk-aligned replay (HARTS "chunk-boundary state recovery and replay"). The chunkwise rule's
results depend (in float rounding) on where its chunk grid falls, and trajectory-wise training
puts the grid at multiples of C = chunk_size along each trajectory. Segment s (depths d_s..e_s)
therefore runs as one sequence over path depths [a_s, c_s) with

    a_s = ⌊d_s / C⌋·C                       start at the chunk boundary at or before d_s
    c_s = e_s + 1            for a leaf      run to the end
    c_s = ⌊(e_s + 1) / C⌋·C  otherwise       stop at the last chunk boundary before the fork

so for every child ch of s, a_ch = c_s: the child replays the parent's tail [c_s, e_s] (and,
if s is shorter than a chunk, tokens of earlier ancestors) from the state at depth c_s. Each
sequence's chunks coincide with a trajectory's chunks, so outputs equal trajectory-wise ones.
A segment with c_s = a_s runs nothing and passes its entry state on. Every token is covered by
exactly one sequence along each root-to-leaf chain; its output is taken from the first sequence
(in schedule order) that covers it, the other copies are replay: they feed states, no outputs.
Without replay, a_s = d_s and c_s = e_s + 1 (each segment starts from its parent's final state).

Only the recurrence is replayed. Everything but the rule is a function of one token and its path,
so it runs once per tree token (T rows): the input projections, the short causal convolution,
whose window is read along the tree path,

    conv_i = silu(Σ_{j=0}^{K−1} w_j · m(anc^{K−1−j}(i))),   anc^0(i) = i, anc^{n+1}(i) = parent(anc^n(i)),

m = the projected conv inputs, 0 for an ancestor above the root (``path_window``) — exactly the
window the trajectory's convolution sees —, the L2-norms and gates (q, k, v, g, β), and after
the rule GatedRMSNorm(o, z) and ``out_proj``. Each call gathers the (q, k, v, g, β) rows of its
sequences and runs only the gated delta rule over them; a sequence's final recurrent state S is
its children's initial state (differentiably, so gradients reach the prefix through it). The rule
thus covers ``plan.rule_tokens`` = T + replayed tokens; everything else covers T.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from arbor.models.gated_deltanet import LinearState
from arbor.models.rows import take_rows


@dataclass
class Segments:
    """Segments of a token tree in index order. start/end: [start, end) token ranges;
    parent: parent segment (−1 = root); depth: depth of the first token; level: depth in the
    segment tree (roots 0); children: child segments in order."""

    start: list[int]
    end: list[int]
    parent: list[int]
    depth: list[int]
    level: list[int]
    children: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.start)


def tree_segments(parents: list[int]) -> Segments:
    """Cut a tree into segments (see module docstring). parents: list, parents[i] < i or −1."""
    n = len(parents)
    num_children = [0] * n
    for p in parents:
        if p >= 0:
            num_children[p] += 1
    seg = Segments([], [], [], [], [])
    seg_of = [0] * n
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError("tree parents must point to earlier tokens (parents[i] < i) or be -1")
        if p >= 0 and p == i - 1 and num_children[p] == 1:
            seg.end[-1] = i + 1
            seg_of[i] = seg_of[p]
            continue
        ps = seg_of[p] if p >= 0 else -1
        depth_i = 0 if p < 0 else seg.depth[ps] + (p - seg.start[ps]) + 1
        seg.start.append(i), seg.end.append(i + 1), seg.parent.append(ps), seg.depth.append(depth_i)
        seg.level.append(0 if ps < 0 else seg.level[ps] + 1)
        seg_of[i] = len(seg.start) - 1
    seg.children = [[] for _ in seg.start]
    for s, ps in enumerate(seg.parent):
        if ps >= 0:
            seg.children[ps].append(s)
    return seg


def segment_depths(seg: Segments, num_tokens: int) -> torch.Tensor:
    """Depth (= position id) of every token: depth of its segment's start + offset."""
    out = torch.empty(num_tokens, dtype=torch.long)
    for s, e, d in zip(seg.start, seg.end, seg.depth):
        out[s:e] = torch.arange(d, d + e - s)
    return out


@dataclass
class LinearCall:
    """One packed call: sequence j runs tokens ``index[cu[j]:cu[j+1]]`` starting from the end
    state of sequence ``init[j]`` of an earlier call (``(call, row)``, None = zeros); positions
    ``own`` of the packed tokens write their outputs to tree tokens ``index[own]``."""

    index: torch.Tensor
    cu_seqlens: torch.Tensor
    init: list[tuple[int, int] | None]
    own: torch.Tensor


@dataclass
class LinearPlan:
    calls: list[LinearCall]
    num_tokens: int
    replayed_tokens: int          # tokens the rule runs more than once (replay), for reporting
    parents: torch.Tensor         # [T] the tree's parent indices (−1 = root)
    windows: dict = field(default_factory=dict)   # conv kernel K → path_window(plan, K)

    @property
    def rule_tokens(self) -> int:
        """Tokens the rule runs over (T + replayed); projections, conv and output run over T."""
        return self.num_tokens + self.replayed_tokens


def plan_linear(parents: list[int], chunk_size: int, replay: bool = True, seg: Segments | None = None) -> LinearPlan:
    """Schedule the tree's tokens into one call per segment level (see module docstring)."""
    seg = tree_segments(parents) if seg is None else seg
    n, C = len(parents), chunk_size

    def tokens_at(s: int, lo: int, hi: int) -> list[int]:
        """Tree tokens at path depths [lo, hi) on the path ending in segment s."""
        out, cur = [], s
        while hi > lo and cur >= 0:
            d0 = seg.depth[cur]
            top = min(hi, d0 + seg.end[cur] - seg.start[cur])
            bottom = max(lo, d0)
            if top > bottom:
                out.append(list(range(seg.start[cur] + bottom - d0, seg.start[cur] + top - d0)))
            hi = min(hi, d0)
            cur = seg.parent[cur]
        return [t for part in reversed(out) for t in part]

    end_state: list[tuple[int, int] | None] = [None] * len(seg)
    covered = torch.zeros(n, dtype=torch.bool)
    calls, replayed = [], 0
    for level in range(max(seg.level, default=-1) + 1):
        index, lengths, init, own = [], [], [], []
        for s in (s for s in range(len(seg)) if seg.level[s] == level):
            d, e1 = seg.depth[s], seg.depth[s] + seg.end[s] - seg.start[s]
            a = (d // C) * C if replay else d
            c = e1 if (not seg.children[s] or not replay) else (e1 // C) * C
            entry = end_state[seg.parent[s]] if seg.parent[s] >= 0 else None
            if c <= a:
                end_state[s] = entry
                continue
            toks = tokens_at(s, a, c)
            assert len(toks) == c - a
            new = ~covered[toks]
            own += (torch.nonzero(new).flatten() + len(index)).tolist()
            replayed += int((~new).sum())
            covered[toks] = True
            end_state[s] = (len(calls), len(lengths))
            index += toks
            lengths.append(len(toks))
            init.append(entry)
        if lengths:
            cu = torch.tensor([0] + lengths).cumsum(0)
            calls.append(LinearCall(torch.tensor(index), cu, init, torch.tensor(own, dtype=torch.long)))
    assert bool(covered.all()), "every tree token must be computed by some call"
    return LinearPlan(calls, n, replayed, torch.tensor(parents, dtype=torch.long))


def tree_gated_deltanet(layer, x: torch.Tensor, plan: LinearPlan, state: LinearState | None = None) -> torch.Tensor:
    """Run a GatedDeltaNet layer over tree tokens x [T, hidden] by the plan → y [T, hidden]
    (module docstring: projections, conv and output once per tree token; only the rule per call).
    Every root starts from the zero state (a tree batch holds whole trajectories)."""
    if state is not None:
        raise ValueError("tree batches start every root from the zero state; pass states=None")
    mixed, z, b, a = layer.conv_inputs(x)
    K = layer.conv_kernel
    window = path_window(plan, K).to(x.device)                      # [T, K]; T = the zero row
    padded = torch.cat([mixed, mixed.new_zeros(1, mixed.shape[1])])
    # the conv as a weighted sum over each token's path window ([T, K, conv_dim] · [K, conv_dim]): a
    # conv1d over T windows of length K has a per-window cost in its backward that dwarfs the sum
    conv = F.silu((take_rows(padded, window) * layer.conv1d.weight[:, 0].t().to(mixed.dtype)).sum(1))
    feats = layer.rule_inputs(conv, b, a)                            # (q, k, v, g, β), one row per tree token
    finals: list[torch.Tensor] = []
    outs, dest = [], []
    for call in plan.calls:
        idx = call.index.to(x.device)
        o, S = layer.rule(*(take_rows(t, idx) for t in feats), call.cu_seqlens, _initial_state(layer, call, finals, x))
        finals.append(S)
        own = call.own.to(x.device)
        outs.append(take_rows(o, own))
        dest.append(idx[own])
    dest = torch.cat(dest)
    order = torch.empty_like(dest)
    order[dest] = torch.arange(dest.numel(), device=dest.device)
    return layer.output(take_rows(torch.cat(outs), order), z, x.dtype)


def path_window(plan: LinearPlan, K: int) -> torch.Tensor:
    """[T, K] tree-token indices of each token's conv window: column K−1−m holds anc^m(i) (the m-th
    ancestor; anc^0(i) = i), and T (a zero row) where the path has fewer than m tokens before i.
    Cached on the plan per K."""
    if K not in plan.windows:
        T, parents = plan.num_tokens, plan.parents
        cur = torch.arange(T, device=parents.device)
        cols = [cur]
        for _ in range(K - 1):
            cur = torch.where(cur >= 0, parents[cur.clamp(min=0)], -1)
            cols.append(cur)
        w = torch.stack(cols[::-1], 1)
        plan.windows[K] = w.masked_fill(w < 0, T)
    return plan.windows[K]


def _initial_state(layer, call: LinearCall, finals: list[torch.Tensor], x: torch.Tensor):
    """The recurrent states the call's sequences start from ([N, Hv, dk, dv]; None when all are zero)."""
    if all(i is None for i in call.init):
        return None
    rule = torch.promote_types(x.dtype, torch.float32)
    zero = x.new_zeros(layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype=rule)
    return torch.stack([zero if i is None else finals[i[0]][i[1]] for i in call.init])


def linear_plan_for(attn, chunk_size: int) -> LinearPlan:
    """The plan for a tree-attention metadata object (anything with ``parents`` [T]); cached on it
    per chunk size. ``attn.linear_replay`` (default True) switches chunk-aligned replay."""
    cache = attn.__dict__.setdefault("_linear_plans", {})
    replay = getattr(attn, "linear_replay", True)
    key = (chunk_size, replay)
    if key not in cache:
        plan = plan_linear(attn.parents.tolist(), chunk_size, replay, getattr(attn, "segments", None))
        for call in plan.calls:  # index once on the tokens' device, not once per layer
            call.index, call.own = call.index.to(attn.parents.device), call.own.to(attn.parents.device)
        plan.parents = plan.parents.to(attn.parents.device)
        cache[key] = plan
    return cache[key]
