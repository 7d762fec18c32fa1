"""Tree batches (HARTS): the trajectories of each group compressed into a prefix tree, several
trees packed per row under a token cap.

Input: per group, a list of trajectories, each a list of token ids (optionally with routed
expert ids [num_moe_layers, len, k] recorded by the engine). The trie merges trajectories on
equal token prefixes, so each shared prefix appears once ("compact tokens").

A ``TreeBatch`` is one packed row (one forward). Its invariants:

- layout is depth-first per tree, trees one after another: ``parents[i] < i`` (−1 = root), and
  a token with a single child is followed by that child, so every fork-free run is contiguous;
- ``positions[i]`` = depth of i = the position token i has in each of its trajectories;
- ``multiplicity[i]`` = number of trajectories through i (Σ_i multiplicity = total tokens);
- ``traj_index[j]`` [L_j] gives, for trajectory ``traj_ids[j]``, the compact index of each of
  its tokens, so ``x_compact[traj_index[j]]`` restores any per-token tensor of trajectory j.

Rows are filled first-fit decreasing by compact tokens; a tree larger than ``token_cap`` gets a
row of its own (trees are never split, so ancestors stay in the row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arbor.plan.packing import first_fit_decreasing


@dataclass
class TreeConfig:
    """The ``tree`` section of ``arbor sft`` (``train.tree``) and ``arbor train``: enabled=False trains
    trajectory-wise (packed sequences, one row per micro-batch)."""

    enabled: bool = True           # train each group's trajectories as one prefix tree
    token_cap: int = 8192          # compact tokens per packed row = per micro-batch
    replay: bool = True            # chunk-aligned replay for linear-attention layers
    attention: str = "segments"    # softmax layers: "segments" (per fork-free run) | "dense" ([T, T] mask)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        from arbor.configs import check
        check(self, (self.attention in ("segments", "dense"), "attention", "must be segments or dense"),
              (self.token_cap >= 1, "token_cap", "must be ≥ 1"))


@dataclass
class Tree:
    """One prefix tree. tokens/parents/multiplicity over compact tokens (local indices);
    paths[j] = compact indices of trajectory j's tokens."""

    tokens: list[int]
    parents: list[int]
    multiplicity: list[int]
    paths: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def total_tokens(self) -> int:
        return sum(len(p) for p in self.paths)


def build_tree(trajectories: list[list[int]]) -> Tree:
    """Trie of the trajectories on shared token prefixes, laid out depth-first (children in
    first-appearance order). A step builds each group's tree more than once (micro-batch sizes, then
    each forward over it), so the last ``TREE_CACHE`` trees are kept, keyed by the token ids
    themselves: a hit returns the same ``Tree`` object (callers never modify one)."""
    if any(len(t) == 0 for t in trajectories):
        raise ValueError("every trajectory needs at least one token")
    key = tuple(tuple(t) for t in trajectories)
    tree = _trees.get(key)
    if tree is None:
        tree = _trees[key] = _build_tree(trajectories)
        while len(_trees) > TREE_CACHE:
            _trees.pop(next(iter(_trees)), None)      # the oldest entry
    return tree


TREE_CACHE = 256            # trees kept by ``build_tree`` (a step's groups, with room to spare)
_trees: dict[tuple, Tree] = {}


def _build_tree(trajectories: list[list[int]]) -> Tree:
    children: list[dict[int, int]] = [{}]  # trie node 0 is a virtual root
    token_of, count, node_paths = [-1], [0], []
    for traj in trajectories:
        node, path = 0, []
        for tok in traj:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(token_of)
                children[node][tok] = nxt
                children.append({}), token_of.append(tok), count.append(0)
            count[nxt] += 1
            path.append(nxt)
            node = nxt
        node_paths.append(path)
    index = [-1] * len(token_of)
    tokens, parents, mult = [], [], []
    stack = [(c, -1) for c in reversed(list(children[0].values()))]
    while stack:
        node, parent = stack.pop()
        index[node] = len(tokens)
        tokens.append(token_of[node]), parents.append(parent), mult.append(count[node])
        stack += [(c, index[node]) for c in reversed(list(children[node].values()))]
    return Tree(tokens, parents, mult, [[index[n] for n in p] for p in node_paths])


@dataclass
class TreeBatch:
    """Several trees packed in one row, one forward (see module docstring for the invariants).
    Per-token training fields (loss masks, old / inference log-probs, advantages) stay in each
    trajectory's own layout; ``traj_index`` maps between the two."""

    tokens: torch.Tensor            # [T] int64
    parents: torch.Tensor           # [T] int64
    positions: torch.Tensor         # [T] int64, depth
    multiplicity: torch.Tensor      # [T] int64
    traj_ids: list[int]             # global trajectory index of each path in this row
    traj_index: list[torch.Tensor]  # [L_j] compact indices of trajectory traj_ids[j]
    routed_experts: torch.Tensor | None = None  # [num_moe_layers, T, k] to replay

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def total_tokens(self) -> int:
        return int(self.multiplicity.sum())

    def to(self, device) -> "TreeBatch":
        mv = lambda t: None if t is None else t.to(device)
        return TreeBatch(mv(self.tokens), mv(self.parents), mv(self.positions), mv(self.multiplicity),
                       self.traj_ids, [mv(t) for t in self.traj_index], mv(self.routed_experts))


def pack_row(trees: list[Tree], traj_ids: list[list[int]], routed: list[list[torch.Tensor]] | None = None) -> TreeBatch:
    """Concatenate trees into one row; traj_ids[t][j] is the global id of tree t's path j;
    routed[t][j] (optional) that trajectory's expert ids [num_moe_layers, L_j, k]."""
    tokens, parents, mult, depth, ids, index = [], [], [], [], [], []
    for t, tree in enumerate(trees):
        off = len(tokens)
        tokens += tree.tokens
        mult += tree.multiplicity
        for i, p in enumerate(tree.parents):
            parents.append(-1 if p < 0 else p + off)
            depth.append(0 if p < 0 else depth[p + off] + 1)
        ids += traj_ids[t]
        index += [torch.tensor(path, dtype=torch.long) + off for path in tree.paths]
    long = lambda x: torch.tensor(x, dtype=torch.long)
    row = TreeBatch(long(tokens), long(parents), long(depth), long(mult), ids, index)
    if routed is not None:
        flat = [r for per_tree in routed for r in per_tree]
        first = flat[0]
        out = first.new_full((first.shape[0], len(tokens), first.shape[2]), -1)
        for r, idx in zip(flat, index):
            if tuple(r.shape[:2]) != (first.shape[0], len(idx)):
                raise ValueError(f"routed experts of shape {tuple(r.shape)} do not align with a "
                                 f"trajectory of {len(idx)} tokens")
            out[:, idx] = r.to(out.device)
        row.routed_experts = out
    return row


def build_rows(groups: list[list[list[int]]], token_cap: int = 8192,
               routed: list[list[torch.Tensor]] | None = None) -> tuple[list[TreeBatch], int]:
    """groups[g] = trajectories (token lists) of group g; trajectories are numbered globally in
    order. routed (optional) mirrors groups with per-trajectory expert ids. → (rows, number of
    trajectories). A shared prefix routes identically in every trajectory (deterministic
    routing), so routed ids of a shared token are taken from any trajectory through it."""
    trees, ids, n = [], [], 0
    for g in groups:
        trees.append(build_tree(g))
        ids.append(list(range(n, n + len(g))))
        n += len(g)
    bins = first_fit_decreasing([t.num_tokens for t in trees], token_cap)
    rows = [pack_row([trees[i] for i in b], [ids[i] for i in b],
                     None if routed is None else [routed[i] for i in b]) for b in bins]
    return rows, n


def group_trajectories(trajectories) -> list[list[list[int]]]:
    """Objects with ``.tokens`` and ``.group`` (e.g. ``rollout.Trajectory``), each group's
    trajectories contiguous → groups of token lists, in input order (so the global trajectory
    numbering of ``build_rows`` is the input order)."""
    groups: list[list[list[int]]] = []
    seen, last = set(), object()
    for t in trajectories:
        if t.group != last:
            if t.group in seen:
                raise ValueError(f"trajectories of group {t.group} are not contiguous")
            seen.add(t.group)
            groups.append([])
            last = t.group
        groups[-1].append(list(t.tokens))
    return groups
