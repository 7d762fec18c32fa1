"""Tree-batch forwards compute what trajectory-wise forwards compute: log-probs, gradients, MoE
counts and routing replay, for dense (Qwen3, Qwen2, Llama 3), MoE and hybrid (Gated DeltaNet + softmax) tiny models.
The models run in float64, so each equality holds to float64 rounding on any CPU."""

import pytest
import torch

from arbor.models import CausalLM, ModelConfig, VarlenAttention, expert_counts
from arbor.models.rows import take_rows
from arbor.models.tree_linear import plan_linear, tree_gated_deltanet
from arbor.train.tree_batch import TreeConfig, build_rows, build_tree
from arbor.train.tree_forward import (
    batch_logprobs, compact_weights, row_expert_counts, row_logprobs, tree_logprobs, trajectory_logprobs)
from tests.test_gated_deltanet import HIDDEN, cu, make_layer
from tests.test_model_attention import DENSE, HYBRID, MOE

LLAMA = DENSE | dict(architecture="LlamaForCausalLM", attention_bias=True, mlp_bias=True, rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))
CFGS = {"dense": DENSE, "moe": MOE, "hybrid": HYBRID, "qwen2": DENSE | dict(architecture="Qwen2ForCausalLM"),
        "llama": LLAMA}


def model_of(cfg, chunk_size=4, seed=0):
    """Tiny model with weights perturbed to O(0.1) and decays like a trained GDN, so chunk-grid
    and branch effects are visible; small chunks exercise replay on short segments."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.normal_(-1.0, 0.5)
            elif "norm" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    for layer in model.model.layers:
        if layer.is_linear:
            layer.linear_attn.chunk_size = chunk_size
    return model.double()


def groups_of(seed=1, vocab=64):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()
    pre = rnd(13)
    a = pre + rnd(5)
    # forks after 13 and 18 tokens, a trajectory that is a prefix of another, a 1-token branch,
    # and a second group of two unrelated trajectories (two roots in one tree)
    g0 = [a + rnd(7), a + rnd(9), pre + rnd(11), pre + rnd(1), a + rnd(2)]
    g0.append(g0[0][:15])
    return [g0, [rnd(6), rnd(10)]]


def flat(groups):
    return [t for g in groups for t in g]


def max_diff(xs, ys):
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


@pytest.mark.parametrize("attention", ["segments", "dense"])
@pytest.mark.parametrize("kind", CFGS)
def test_tree_logprobs_equal_trajectory_wise(kind, attention):
    model, groups = model_of(CFGS[kind]).eval(), groups_of()
    with torch.no_grad():
        tree = batch_logprobs(model, groups, TreeConfig(token_cap=40, attention=attention))
        ref = batch_logprobs(model, groups, TreeConfig(enabled=False))
    assert [len(t) for t in tree] == [len(t) for t in flat(groups)]
    assert ref[0].abs().mean() > 1.0
    assert max_diff(tree, ref) <= 1e-10      # float64, log-probs ≲ 6: measured 8.9e-16


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_linear_layer_tree_with_and_without_replay(chunk_size, capsys):
    """One Gated DeltaNet layer with O(1) weights: the tree schedule vs each path alone."""
    layer, trajs = make_layer(chunk_size), flat(groups_of(2, vocab=1000))
    tree = build_tree(trajs)
    emb = torch.randn(1000, HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    diffs = {}
    with torch.no_grad():
        ref = [layer(emb[torch.tensor(t)], cu(len(t)))[0] for t in trajs]
        for replay in (True, False):
            plan = plan_linear(tree.parents, chunk_size, replay)
            y = tree_gated_deltanet(layer, emb[torch.tensor(tree.tokens)], plan)
            diffs[replay] = max_diff([y[p] for p in tree.paths], ref)
    with capsys.disabled():
        print(f"\n  C={chunk_size}: max |tree − trajectory| with replay {diffs[True]:.2e}, without {diffs[False]:.2e}")
    assert ref[0].abs().mean() > 0.1
    assert diffs[True] <= 1e-10   # float64, outputs O(1): measured 1.3e-15
    assert diffs[False] <= 1e-10  # same function, chunk grid shifted: float64 rounding only, measured 7.1e-15


def test_replay_reruns_only_the_recurrence():
    """HARTS replays the recurrent state only: the input projections and the output projection see
    each tree token once (T rows), while the rule runs over T + replayed tokens; outputs and the
    gradients of every parameter and input still equal each path run alone (float64)."""
    layer, trajs = make_layer(4), flat(groups_of(2, vocab=1000))
    tree = build_tree(trajs)
    emb = torch.randn(1000, HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = {"in_proj_qkvz": 0, "in_proj_ba": 0, "out_proj": 0}
    hooks = [getattr(layer, name).register_forward_hook(
        lambda m, args, out, name=name: rows.__setitem__(name, rows[name] + args[0].shape[0])) for name in rows]
    plan = plan_linear(tree.parents, 4, replay=True)
    x = emb[torch.tensor(tree.tokens)].requires_grad_()
    y = tree_gated_deltanet(layer, x, plan)
    for h in hooks:
        h.remove()
    T = len(tree.tokens)
    assert plan.replayed_tokens >= 5 and plan.rule_tokens == T + plan.replayed_tokens
    assert rows == {"in_proj_qkvz": T, "in_proj_ba": T, "out_proj": T}
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (w * y).sum().backward()
    g_tree = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad()
    x_ref = emb[torch.tensor(tree.tokens)].requires_grad_()
    ref = [layer(take_rows(x_ref, torch.tensor(p)), cu(len(p)))[0] for p in tree.paths]
    # each tree token's output counted once: weight it on the first path through it
    first = {}
    for j, p in enumerate(tree.paths):
        for d, i in enumerate(p):
            first.setdefault(i, (j, d))
    loss = sum((w[i] * ref[j][d]).sum() for i, (j, d) in first.items())
    loss.backward()
    assert max_diff([y[p] for p in tree.paths], [r.detach() for r in ref]) <= 1e-10   # float64, outputs O(1): measured 7e-15
    g_ref = {n: p.grad for n, p in layer.named_parameters()} | {"x": x_ref.grad}
    for name, g in g_ref.items():
        assert g.abs().max() > 0, name
        assert (g_tree[name] - g).abs().max() <= 1e-10 * g.abs().max(), name      # float64: rounding only


def test_hybrid_without_replay_close(capsys):
    model, groups = model_of(HYBRID).eval(), groups_of()
    with torch.no_grad():
        tree = batch_logprobs(model, groups, TreeConfig(replay=False))
        ref = batch_logprobs(model, groups, TreeConfig(enabled=False))
    with capsys.disabled():
        print(f"\n  hybrid log-probs without replay: max diff {max_diff(tree, ref):.2e}")
    assert max_diff(tree, ref) <= 1e-10      # float64, same function on another chunk grid: measured 2.7e-15


def rl_grads(model, logps_fn, advantages):
    model.zero_grad()
    loss = -sum(a * lp.sum() for a, lp in zip(advantages, logps_fn()))
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kind", CFGS)
def test_rl_gradients_equal_trajectory_wise(kind, recompute):
    model, groups = model_of(CFGS[kind]).train(), groups_of()
    model.gradient_checkpointing = recompute
    adv = torch.randn(len(flat(groups)), generator=torch.Generator().manual_seed(3))
    rows, n = build_rows(groups, token_cap=40)
    g_tree = rl_grads(model, lambda: tree_logprobs(model, rows, n), adv)
    g_ref = rl_grads(model, lambda: trajectory_logprobs(model, flat(groups)), adv)
    for name, ref in g_ref.items():
        scale = ref.abs().max()
        assert scale > 0, name
        assert (g_tree[name] - ref).abs().max() <= 1e-10 * scale, name   # float64: measured 2.1e-15 × scale


def test_compact_weights_give_same_loss_and_gradient():
    model, groups = model_of(HYBRID).train(), groups_of()
    (row,), n = build_rows(groups[:1], token_cap=100)
    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(len(idx), generator=gen, dtype=torch.float64) for idx in row.traj_index]
    model.zero_grad()
    out = row_logprobs(model, row)
    loss_traj = sum((w * lp).sum() for w, lp in zip(weights, out.per_trajectory))
    loss_traj.backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    W = compact_weights(row, weights)
    loss_tree = (W * row_logprobs(model, row).logp).sum()
    loss_tree.backward()
    assert abs(loss_tree.item() - loss_traj.item()) <= 1e-12 * abs(loss_traj.item())   # float64: measured 1.2e-16 relative
    assert torch.equal(compact_weights(row, [torch.ones(len(i)) for i in row.traj_index]), row.multiplicity.float())
    for a, b in zip(g0, (p.grad for p in model.parameters())):
        assert (a - b).abs().max() <= 1e-10 * a.abs().max().clamp(min=1e-12)   # float64: measured 1.2e-15 × max


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_changing_one_branch_leaves_others(kind):
    model, groups = model_of(CFGS[kind]).eval(), groups_of()
    changed = [list(t) for t in groups[0]]
    changed[1][-4:] = [(x + 7) % 64 for x in changed[1][-4:]]  # only trajectory 1's own tail
    with torch.no_grad():
        base = batch_logprobs(model, [groups[0]])
        new = batch_logprobs(model, [changed])
    tail = len(changed[1]) - 4
    for j in range(len(changed)):
        if j == 1:
            assert (base[j][:tail] - new[j][:tail]).abs().max() <= 1e-10   # float64, log-probs ≲ 6: measured 0
            assert (base[j][tail:] - new[j][tail:]).abs().max() > 1e-3     # a changed token moves log-probs by O(0.1)
        else:
            assert (base[j] - new[j]).abs().max() <= 1e-10, j              # float64: measured 0


@pytest.mark.parametrize("kind", ["moe", "hybrid"])
def test_moe_counts_and_routing_replay(kind):
    model, groups = model_of(CFGS[kind]).train(), groups_of()
    model.gradient_checkpointing = True
    trajs, E = flat(groups), model.config.num_experts
    rows, n = build_rows(groups, token_cap=1000)
    (row,) = rows
    ref_counts, recorded = 0, []
    with torch.no_grad():
        for t in trajs:  # what the engine would record, one trajectory at a time
            out = model(torch.tensor(t), VarlenAttention.from_lengths([len(t)]), return_routing=True)
            recorded.append(out.routed_experts)
            ref_counts = ref_counts + expert_counts(out.routed_experts, E)
    out = row_logprobs(model, row, return_routing=True)
    out.logp.sum().backward()  # recomputation re-runs the router; counts come from the output once
    counts = row_expert_counts(out.routed_experts, row, E)
    assert torch.equal(counts, ref_counts.to(counts.dtype))
    assert counts.sum() == row.total_tokens * model.config.num_experts_per_tok * len(recorded[0])
    # replay the recorded ids on the tree batch: same ids back, same log-probs as trajectory-wise replay
    (rrow,), _ = build_rows(groups, token_cap=1000, routed=[recorded[:len(groups[0])], recorded[len(groups[0]):]])
    with torch.no_grad():
        rep = row_logprobs(model, rrow, return_routing=True)
        ref = trajectory_logprobs(model, trajs, routed=recorded)
    assert torch.equal(rep.routed_experts, rrow.routed_experts)
    tree = [None] * n
    for j, lp in zip(rrow.traj_ids, rep.per_trajectory):
        tree[j] = lp
    assert max_diff(tree, ref) <= 1e-10      # float64, log-probs ≲ 6: measured 8.9e-16


def test_tree_packed_logprobs_is_a_drop_in():
    from arbor.train.logprobs import packed_logprobs
    from arbor.train.tree_forward import tree_packed_logprobs
    model, seqs = model_of(HYBRID).eval(), flat(groups_of())
    with torch.no_grad():
        ref, cu_ref = packed_logprobs(model, seqs)
        recorded = model(torch.tensor([t for s in seqs for t in s]), VarlenAttention.from_lengths(
            [len(s) for s in seqs]), return_routing=True).routed_experts
        tree, cu = tree_packed_logprobs(model, seqs)
        replayed, _ = tree_packed_logprobs(model, seqs, routed_experts=recorded)
    assert torch.equal(cu, cu_ref) and tree.shape == ref.shape
    assert (tree - ref).abs().max() <= 1e-10 and (replayed - ref).abs().max() <= 1e-10   # float64, log-probs ≲ 6: measured 8.9e-16


def test_hybrid_on_any_tree_order():
    """Plain TreeAttention with two branches interleaved token by token (not depth-first): every
    token is its own segment, and the linear layers still match each path alone."""
    from arbor.models import TreeAttention
    model = model_of(HYBRID).eval()
    gen = torch.Generator().manual_seed(7)
    parents = [-1, 0, 1, 2, 3]                                   # shared prefix of 5
    a, b = [4], [4]
    for _ in range(6):                                           # branches a and b, interleaved
        parents.append(a[-1]), a.append(len(parents) - 1)
        parents.append(b[-1]), b.append(len(parents) - 1)
    ids = torch.randint(0, 64, (len(parents),), generator=gen)
    with torch.no_grad():
        tree = model.logits(model(ids, TreeAttention(torch.tensor(parents))).hidden)
        for branch in (a, b):
            path = [0, 1, 2, 3] + branch
            alone = model.logits(model(ids[path], VarlenAttention.from_lengths([len(path)])).hidden)
            assert (tree[path] - alone).abs().max() <= 1e-10     # float64, logits O(1): measured 2.1e-15


@pytest.mark.parametrize("kind", ["moe", "hybrid"])
def test_moe_aux_loss_of_a_tree_equals_trajectory_wise(kind):
    """The load-balancing loss counts a shared token once per trajectory through it (semantic
    multiplicities): its value and its gradient equal those of the trajectories packed one by one."""
    from arbor.train.logprobs import packed_logprobs
    from arbor.train.tree_forward import tree_packed_logprobs
    model, seqs = model_of(CFGS[kind]), groups_of()[0]
    grads, values = [], []
    for fn in (tree_packed_logprobs, packed_logprobs):
        model.zero_grad()
        _, _, aux = fn(model, seqs, with_aux=True)
        aux.backward()
        values.append(aux.item())
        grads.append(torch.cat([layer.mlp.gate.weight.grad.flatten() for layer in model.model.layers if layer.is_moe]))
    assert values[0] > 0.9 and values[0] == pytest.approx(values[1], rel=1e-12)   # ≈ 1 when balanced; float64: 2e-16
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=1e-10)   # float64, gradients ≤ 0.25: measured 8.3e-17
    out = model(torch.tensor(seqs[0]), VarlenAttention.from_lengths([len(seqs[0])]), return_router_probs=True)
    assert out.router_probs.shape[:2] == out.routed_experts.shape[:2] == (len(model.config.moe_layers), len(seqs[0]))
    assert torch.allclose(out.router_probs.sum(-1), torch.ones((), dtype=torch.float64), rtol=0, atol=1e-12)  # f64
