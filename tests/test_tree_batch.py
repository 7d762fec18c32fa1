"""Tree batches: trie layout invariants, row packing, segments and the linear-attention plan, planning."""

import pytest
import torch

from arbor.models.attention import ancestor_mask, tree_depths
from arbor.models.tree_linear import plan_linear, tree_segments
from arbor.train.tree_batch import TreeConfig, build_rows, build_tree, group_trajectories
from arbor.plan.packing import first_fit_decreasing
from arbor.train.tree_plan import assign_lpt, plan_rows


def random_group(seed, prefix=12, branches=(3, 2), seg=(3, 9), vocab=50):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()
    length = lambda: int(torch.randint(seg[0], seg[1] + 1, (), generator=gen))
    trajs = [rnd(prefix)]
    for b in branches:
        trajs = [t + rnd(length()) for t in trajs for _ in range(b)]
    return trajs


def test_trie_restores_every_trajectory():
    trajs = random_group(0) + [[1, 2, 3], [1, 2, 3, 4], [1, 2]]  # prefixes of one another too
    tree = build_tree(trajs)
    assert tree.total_tokens == sum(map(len, trajs))
    assert tree.num_tokens == len({tuple(t[:k]) for t in trajs for k in range(1, len(t) + 1)})
    for traj, path in zip(trajs, tree.paths):
        assert [tree.tokens[i] for i in path] == traj
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:])) and tree.parents[path[0]] == -1
    counts = [0] * tree.num_tokens
    for path in tree.paths:
        for i in path:
            counts[i] += 1
    assert counts == tree.multiplicity
    # each shared prefix once: no two compact tokens with the same parent hold the same id
    seen = {(p, t) for p, t in zip(tree.parents, tree.tokens)}
    assert len(seen) == tree.num_tokens


def test_depth_first_layout_and_positions():
    groups = [random_group(s) for s in range(3)]
    rows, n = build_rows(groups, token_cap=90)
    assert n == 18 and len(rows) >= 2
    ids = sorted(j for r in rows for j in r.traj_ids)
    assert ids == list(range(18))
    for row in rows:
        parents = row.parents
        assert bool((parents < torch.arange(row.num_tokens)).all())
        assert torch.equal(row.positions, tree_depths(parents))
        children = torch.bincount(parents[parents >= 0], minlength=row.num_tokens)
        single = (children == 1).nonzero().flatten()
        nxt = single + 1
        assert bool((parents[nxt] == single).all()), "a single child must follow its parent"
        mask = ancestor_mask(parents)
        for j, idx in zip(row.traj_ids, row.traj_index):
            flat = [t for g in groups for t in g]
            assert row.tokens[idx].tolist() == flat[j]
            assert mask[idx[-1]].nonzero().flatten().tolist() == idx.tolist()


def test_token_cap_and_oversized_tree():
    groups = [random_group(s) for s in range(4)] + [random_group(9, prefix=200)]
    rows, _ = build_rows(groups, token_cap=120)
    sizes = [r.num_tokens for r in rows]
    big = [s for s in sizes if s > 120]
    assert len(big) == 1 and sum(sizes) == sum(build_tree(g).num_tokens for g in groups)


def test_segments_cut_at_forks():
    #       0-1-2 ┬ 3-4        tokens 5, 6 hang off 2; 7 is a second root
    #             └ 5-6
    parents = [-1, 0, 1, 2, 3, 2, 5, -1, 7]
    seg = tree_segments(parents)
    assert list(zip(seg.start, seg.end)) == [(0, 3), (3, 5), (5, 7), (7, 9)]
    assert seg.parent == [-1, 0, 0, -1] and seg.depth == [0, 3, 3, 0] and seg.level == [0, 1, 1, 0]


@pytest.mark.parametrize("replay", [True, False])
def test_linear_plan_covers_each_token_once(replay):
    tree = build_tree(random_group(1, prefix=10, branches=(3, 2, 2), seg=(1, 7)))
    plan = plan_linear(tree.parents, chunk_size=4, replay=replay)
    owned = torch.cat([c.index[c.own] for c in plan.calls])
    assert sorted(owned.tolist()) == list(range(tree.num_tokens))
    levels = max(tree_segments(tree.parents).level) + 1
    assert len(plan.calls) <= levels
    assert (plan.replayed_tokens > 0) == replay
    for call in plan.calls:  # with replay every sequence starts on a chunk boundary of its path
        starts = call.index[call.cu_seqlens[:-1]]
        depth = tree_depths(torch.tensor(tree.parents))[starts]
        if replay:
            assert bool((depth % 4 == 0).all())


def test_first_fit_and_lpt():
    sizes = [7, 5, 4, 4, 3, 2, 12]
    bins = first_fit_decreasing(sizes, 10)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins if len(b) > 1)
    ranks = assign_lpt([8, 7, 6, 5, 4], 2)
    loads = sorted(sum([8, 7, 6, 5, 4][i] for i in r) for r in ranks)
    assert loads == [13, 17]  # greedy LPT (optimum 15/15); within Graham's 7/6 bound
    rows = [8, 7, 6, 5, 4, 3, 3, 12]
    plan = plan_rows(rows, dp_size=2, token_cap=10)
    assert len(plan) == 2 and sorted(i for r in plan for s in r for i in s) == list(range(8))
    assert all(sum(rows[i] for i in s) <= 10 for r in plan for s in r if len(s) > 1)   # 12 trains alone
    per_rank = [sum(rows[i] for s in r for i in s) for r in plan]
    assert max(per_rank) - min(per_rank) <= max(rows)


def test_config_validates():
    assert TreeConfig().enabled is True
    with pytest.raises(ValueError, match="segments or dense"):
        TreeConfig(attention="flash")


def test_group_trajectories_keeps_order():
    from types import SimpleNamespace as T
    trajs = [T(tokens=[1, 2], group=5), T(tokens=[1, 3], group=5), T(tokens=[4], group=2)]
    assert group_trajectories(trajs) == [[[1, 2], [1, 3]], [[4]]]
    with pytest.raises(ValueError, match="not contiguous"):
        group_trajectories(trajs + [T(tokens=[9], group=5)])


def test_moe_aux_loss_with_multiplicities_equals_expanded():
    from arbor.train.losses import moe_aux_loss
    (row,), _ = build_rows([random_group(3)], token_cap=1000)
    gen = torch.Generator().manual_seed(0)
    probs = torch.randn(row.num_tokens, 6, generator=gen, dtype=torch.float64).softmax(-1)   # float64: sum order only
    ids = probs.topk(2, -1).indices
    flat = torch.cat(row.traj_index)  # every trajectory's tokens, shared ones repeated
    expanded = moe_aux_loss(probs[flat], ids[flat], torch.ones(len(flat)))
    assert torch.allclose(moe_aux_loss(probs, ids, row.multiplicity), expanded, rtol=0, atol=1e-12)   # f64, ≈ 1: measured 0
    assert not torch.allclose(moe_aux_loss(probs, ids, torch.ones(row.num_tokens)), expanded, atol=1e-4)  # differs by 0.018


def test_build_tree_reuses_the_tree_of_the_same_trajectories():
    """A step builds a group's tree for its micro-batch sizes and again for each forward: the second
    build returns the first ``Tree`` (keyed by the token ids); other ids get their own; the cache is bounded."""
    from arbor.train import tree_batch
    a = [[1, 2, 3, 4], [1, 2, 5]]
    first = tree_batch.build_tree(a)
    assert tree_batch.build_tree([list(t) for t in a]) is first
    other = tree_batch.build_tree([[1, 2, 3, 4], [1, 2, 6]])
    assert other is not first and other.tokens == [1, 2, 3, 4, 6] and first.tokens == [1, 2, 3, 4, 5]
    for k in range(tree_batch.TREE_CACHE + 1):
        tree_batch.build_tree([[k + 1000]])
    assert len(tree_batch._trees) <= tree_batch.TREE_CACHE and tree_batch.build_tree(a) is not first
