"""arbor.plan: packing certificates, placement, annealed layout, baselines, cost fit (numpy only, fast).

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import itertools

import numpy as np
import pytest

from arbor.plan import AnnealConfig, CostModel, Sample, balanced, karmarkar_karp, kk_workload, pack_rows, routepack, \
    token_balance
from arbor.plan.cost import fit
from arbor.plan.layout import anneal, energy
from arbor.plan.packing import best_fit_decreasing, lower_bound_l1, lower_bound_l2, min_slack
from arbor.plan.routepack import grid_start, problem, step_lower_bound
from arbor.plan.traces import synthetic

COST = CostModel(a=2e-4, b=1e-7, e=1e-4, c0=5e-3)
FAST = AnnealConfig(population=8, levels=6, sweeps=24)


def opt_rows(sizes, cap) -> int:
    """Brute-force minimum number of rows (tiny instances)."""
    for k in range(1, len(sizes) + 1):
        for assign in itertools.product(range(k), repeat=len(sizes)):
            if assign[0] == 0 and all(sum(s for s, a in zip(sizes, assign) if a == b) <= cap for b in range(k)):
                return k
    return len(sizes)


def test_certificate_by_l2_where_l1_is_not_tight():
    p = pack_rows([6, 6, 6], 10)           # Σ = 18 → L1 = 2; no two items share a row → L2 = 3
    assert (p.l1, p.l2, len(p.rows), p.certified, p.status) == (2, 3, 3, True, "certified")


def test_certificate_by_l1_and_a_best_known_gap():
    p = pack_rows([5, 5, 5, 5, 3, 3, 2, 2], 10)
    assert p.l1 == 3 and len(p.rows) == 3 and p.certified
    q = pack_rows([4] * 5, 10)             # optimum 3 (two per row), but L1 = L2 = 2: not provable here
    assert (q.l1, q.l2, len(q.rows)) == (2, 2, 3)
    assert not q.certified and q.gap == 1 and q.status == "best known (gap 1)"


def test_bounds_are_sound_and_bfd_valid_on_random_tiny_instances():
    rng = np.random.default_rng(1)
    for _ in range(60):
        cap = int(rng.integers(8, 20))
        sizes = rng.integers(1, cap + 1, size=int(rng.integers(1, 7))).tolist()
        best = opt_rows(sizes, cap)
        assert lower_bound_l1(sizes, cap) <= lower_bound_l2(sizes, cap) <= best
        p = pack_rows(sizes, cap)
        assert sorted(i for r in p.rows for i in r) == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in r) <= cap for r in p.rows)
        assert len(p.rows) >= best and (not p.certified or len(p.rows) == best)
        rows = min_slack(sizes, cap)
        assert sorted(i for r in rows for i in r) == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in r) <= cap for r in rows) and len(rows) >= best


def test_min_slack_certifies_where_bfd_does_not():
    sizes = [52, 42, 41, 34, 13, 13]      # BFD: {52, 42} {41, 34, 13} {13}; MBS': {52, 34, 13} {42, 41, 13}
    assert len(best_fit_decreasing(sizes, 100)) == 3 and len(min_slack(sizes, 100)) == 2
    p = pack_rows(sizes, 100, tries=0)
    assert len(p.rows) == 2 and p.certified and p.l1 == 2


def test_samples_over_the_cap_are_refused():
    with pytest.raises(ValueError, match=r"1\.\.10 \(the token cap\)"):
        pack_rows([3, 11], 10)


def test_placement_reaches_the_known_optimum():
    demand = [17, 13, 10, 6, 6, 1]         # greedy alone: 29 ({17, 6, 6} vs {13, 10, 1}); optimum 28
    best = min(max(sum(demand[i] for i in c), sum(demand) - sum(demand[i] for i in c))
               for c in itertools.combinations(range(6), 3))
    p = balanced(demand, 2)
    assert best == 28 and p.max_load == 28
    assert sorted(p.rank_of) == [0, 0, 0, 1, 1, 1] and p.lower_bound == 26.5
    assert p.max_over_mean == pytest.approx(28 / 26.5)
    q = balanced([8, 1, 1, 1, 1, 1, 1, 1], 4)
    assert q.max_load == 9 == q.lower_bound       # the busiest expert + the lightest one


def fewest_moves(demand, ep_size, current) -> tuple[float, int]:
    """Brute force: (least max load of any placement with E / W experts per rank, fewest experts moved
    from ``current`` among the placements with that load)."""
    L = len(demand) // ep_size
    return min((max(np.bincount(ranks, demand, ep_size)), sum(r != c for r, c in zip(ranks, current)))
               for ranks in itertools.product(range(ep_size), repeat=len(demand))
               if np.bincount(ranks, minlength=ep_size).tolist() == [L] * ep_size)


@pytest.mark.parametrize("demand, current, want", [
    ([4, 4, 1, 1], [1, 0, 1, 0], (5, 0)),                   # already optimal (ranks relabelled): nothing moves
    ([4, 4, 1, 1], [0, 0, 1, 1], (5, 2)),                   # a 4 and a 1 trade ranks
    # 3 ranks: the best of the 6 relabellings of the fresh packing moves 3 (as labelled: 6; swaps from current: 5)
    ([7, 19, 11, 2, 9, 19, 3, 5, 19], [1, 0, 0, 2, 2, 1, 2, 0, 1], (32, 3)),
])
def test_placement_keeps_experts_where_they_are_when_labels_tie(demand, current, want):
    W = len(set(current))
    assert fewest_moves(demand, W, current) == want
    p = balanced(demand, W, current=current)
    assert (p.max_load, sum(a != b for a, b in zip(p.rank_of, current))) == want


def trace(seed, n=24, experts=8, layers=2, max_len=256):
    ids, _ = synthetic(n, experts, layers, 2, seed=seed, max_len=max_len, min_len=8)
    return [Sample.from_ids(x, experts) for x in ids]


@pytest.mark.parametrize("seed", range(6))
def test_routepack_plans_keep_every_invariant(seed):
    rng = np.random.default_rng(seed)
    dp, ep = [(2, 2), (4, 2), (2, 1), (4, 4)][seed % 4]
    samples = trace(seed, n=int(rng.integers(12, 40)))
    cap = int(rng.integers(256, 1024))
    plan = routepack(samples, ep, dp, cap, COST, anneal_cfg=FAST)
    cells = [c for rank in plan.cells for c in rank]
    assert len(plan.cells) == dp and len({len(rank) for rank in plan.cells}) == 1        # equal counts per rank
    assert sorted(i for c in cells for i in c) == list(range(len(samples)))              # each sample once
    assert all(c for c in cells)                                                         # no empty cell
    assert all(sum(samples[i].length for i in c) <= cap for c in cells)                  # capacity
    assert len(plan.packing.rows) >= plan.packing.bound and plan.slots == -(-len(plan.packing.rows) // dp)
    for p in plan.placements:
        assert sorted(p.rank_of) == sorted(list(range(ep)) * (8 // ep))
    assert plan.energy <= plan.stats["start_energy"] + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_step_lower_bound_is_below_every_plan(seed):
    rng = np.random.default_rng(seed)
    dp, ep = [(2, 2), (4, 2), (2, 1), (4, 4)][seed]
    samples = trace(seed + 10, n=int(rng.integers(16, 40)))
    cap = int(rng.integers(256, 1024))
    bound = step_lower_bound(samples, ep, dp, cap, COST)
    plans = [routepack(samples, ep, dp, cap, COST, anneal_cfg=FAST), token_balance(samples, ep, dp, cap, COST),
             kk_workload(samples, ep, dp, cap, COST)]
    assert 0 < bound <= min(p.energy for p in plans) + 1e-12


def test_step_lower_bound_is_reached_where_the_optimum_is_known():
    """2 samples of equal length, each routing all its copies to its own expert of 4 (2 per EP rank):
    one per DP rank and the two experts on different EP ranks is optimal, and the bound is its cost:
    c0 + A(n) + e·n per layer."""
    counts = [np.array([[100, 0, 0, 0]]), np.array([[0, 100, 0, 0]])]
    samples = [Sample(100, c) for c in counts]
    bound = step_lower_bound(samples, 2, 2, 128, COST)
    assert bound == pytest.approx(COST.c0 + COST.attention([100])[0] + COST.e * 100)
    plan = routepack(samples, 2, 2, 128, COST, anneal_cfg=FAST)
    assert plan.energy == pytest.approx(bound)


def test_too_few_samples_for_the_grid_is_an_error():
    samples = [Sample(60, np.ones((1, 4))) for _ in range(3)]     # 3 rows of 60 under cap 100, 2 ranks → 4 cells
    with pytest.raises(ValueError, match="cannot fill 2 x 2"):
        routepack(samples, 2, 2, 100, COST, anneal_cfg=FAST)


def test_annealing_is_deterministic_per_seed_and_never_worse_than_its_start():
    samples = trace(7, n=32)
    plan = routepack(samples, 2, 2, 512, COST, anneal_cfg=FAST)
    prob = problem(samples, plan.placements, 2, plan.slots, 2, 512, COST)
    start = grid_start(plan.packing.rows, prob.lengths, prob.attn, 2)
    a, sa = anneal(prob, start, AnnealConfig(population=8, levels=6, sweeps=24, seed=3))
    b, sb = anneal(prob, start, AnnealConfig(population=8, levels=6, sweeps=24, seed=3))
    assert np.array_equal(a, b) and sa == sb
    assert energy(prob, a) <= energy(prob, start)
    hot = AnnealConfig(population=4, levels=2, sweeps=8, beta_lo=1e-6, beta_hi=1e-5, seed=0)   # a random walk
    for seed in range(5):
        c, st = anneal(prob, start, AnnealConfig(**{**hot.__dict__, "seed": seed}))
        assert energy(prob, c) <= energy(prob, start) and st["energy"] == energy(prob, c)


def test_baselines_cover_every_sample_and_kk_balances():
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]     # KK's classic answer (optimum 15/15)
    samples = trace(3, n=30)
    for plan in (token_balance(samples, 2, 2, 512, COST), kk_workload(samples, 2, 2, 512, COST)):
        cells = [c for rank in plan.cells for c in rank]
        assert sorted(i for c in cells for i in c) == list(range(30))
        assert all(sum(samples[i].length for i in c) <= 512 for c in cells)
        assert len({len(r) for r in plan.cells}) == 1
        assert [p.rank_of for p in plan.placements] == [[0, 0, 0, 0, 1, 1, 1, 1]] * 2   # static contiguous


def test_cost_fit_recovers_known_coefficients():
    rows = [64, 128, 256, 512]
    runs = [{"lengths": [n] * k, "seconds": 0.0} for n, k in ((32, 8), (128, 4), (256, 2), (512, 1), (1024, 1),
                                                              (64, 16))]
    truth = CostModel(a=3e-4, b=2e-7, e=5e-5, c0=1e-2, c1=2e-3)
    for r in runs:
        T = sum(r["lengths"])
        r["seconds"] = truth.c0 + truth.attention(r["lengths"]).sum() + truth.e * 2 * 2 * T
    got = fit(rows, [1e-3 + truth.e * R for R in rows], runs, moe_layers=2, top_k=2)
    for k in ("a", "b", "e", "c0", "c1"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-6)
    assert got.meta["step_fit_r2"] > 0.999


def test_cost_model_round_trips_through_json(tmp_path):
    path = COST.save(tmp_path / "cost.json")
    back = CostModel.load(path)
    assert (back.a, back.b, back.e, back.c0, back.c1) == (COST.a, COST.b, COST.e, COST.c0, COST.c1)
    with pytest.raises(FileNotFoundError, match="arbor plan calibrate"):
        CostModel.load(tmp_path / "missing.json")


def test_plan_package_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, arbor.plan, arbor.plan.traces; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def _moves(rank_of, current) -> int:
    return int(np.sum(np.asarray(rank_of) != np.asarray(current)))


@pytest.mark.parametrize("seed", range(8))
def test_placement_from_current_never_moves_more_than_the_relabelled_one(seed):
    from arbor.plan.placement import relabel
    rng = np.random.default_rng(seed)
    W, E = [(2, 8), (2, 16), (4, 16), (4, 8)][seed % 4]
    d = rng.zipf(1.5, E).astype(float) + rng.random(E)
    current = rng.permutation(np.repeat(np.arange(W), E // W)).tolist()
    fresh = balanced(d, W)
    relabelled = relabel(fresh, current)
    assert sorted(relabelled.loads) == pytest.approx(sorted(fresh.loads))
    assert _moves(relabelled.rank_of, current) <= _moves(fresh.rank_of, current)
    for tol in (0.0, 0.02, 0.1, 1.0):
        p = balanced(d, W, current=current, tolerance=tol)
        assert sorted(p.rank_of) == sorted(list(range(W)) * (E // W))                 # equal experts per rank
        assert np.allclose(p.loads, np.bincount(p.rank_of, d, W))                     # loads of its own placement
        assert p.max_load <= (1 + tol) * fresh.max_load + 1e-9
        assert _moves(p.rank_of, current) <= _moves(relabelled.rank_of, current)
    assert balanced(d, W, current=current, tolerance=1e9).rank_of == current           # no gain worth a move


def test_relabel_keeps_the_groups_and_their_loads():
    from arbor.plan.placement import relabel
    d = np.array([5.0, 1, 2, 7, 3, 3])
    p = balanced(d, 3)
    q = relabel(p, [2, 2, 1, 1, 0, 0])
    assert sorted(map(sorted, (p.experts_of(r) for r in range(3)))) == sorted(map(sorted, (q.experts_of(r) for r in range(3))))
    assert np.allclose(q.loads, np.bincount(q.rank_of, d, 3)) and q.max_load == p.max_load
    assert _moves(q.rank_of, [2, 2, 1, 1, 0, 0]) <= _moves(p.rank_of, [2, 2, 1, 1, 0, 0])


def test_refine_lowers_the_slot_peaks_and_pays_for_its_moves():
    from arbor.plan.placement import contiguous, refine
    rng = np.random.default_rng(0)
    X = rng.integers(0, 50, (3, 2, 8)).astype(float)                     # 3 slots, 2 MoE layers, 8 experts
    start = [contiguous(8, 2, X[:, l].sum(0)) for l in range(2)]
    peaks = lambda p, l: (X[:, l] @ np.eye(2)[np.asarray(p.rank_of)]).max(1).sum()
    out = refine(start, X)
    for l in range(2):
        best = min((X[:, l] @ np.eye(2)[[int(e in c) for e in range(8)]]).max(1).sum()
                   for c in itertools.combinations(range(8), 4))
        assert best <= peaks(out[l], l) <= peaks(start[l], l)
        assert sorted(out[l].rank_of) == [0] * 4 + [1] * 4
    assert peaks(out[0], 0) < peaks(start[0], 0)
    current = [p.rank_of for p in start]
    assert [p.rank_of for p in refine(start, X, current, move_rows=1e6)] == current     # no swap pays for its moves


def test_plan_window_shares_a_placement_and_is_never_worse_than_unrefined():
    from arbor.plan.routepack import place, plan_window, window_cost
    steps = [trace(s, n=24, experts=8) for s in (11, 12)]
    current = [[0, 1] * 4, [1, 0] * 4]
    for move_s in (0.0, 0.05):
        plans = plan_window(steps, 2, 2, 512, COST, current, FAST, tolerance=0.02, move_s=move_s)
        assert len(plans) == 2 and all(p.placements == plans[0].placements for p in plans)
        for p, samples in zip(plans, steps):
            assert sorted(i for rank in p.cells for c in rank for i in c) == list(range(len(samples)))
        unrefined = place([x for s in steps for x in s], 2, current, 0.02)
        first = [routepack(s, 2, 2, 512, COST, anneal_cfg=FAST, placements=unrefined) for s in steps]
        assert window_cost(plans, current, move_s) <= window_cost(first, current, move_s) + 1e-12


def test_warm_relayout_reuses_the_rows_and_is_never_worse_than_the_rescored_start():
    """The refine step's second pass starts from the first layout under another placement."""
    from arbor.plan.placement import contiguous
    from arbor.plan.routepack import _plan_step, evaluate, place, plan_window, warm_config
    samples = trace(5, n=40)
    places = place(samples, 2)
    first = _plan_step(samples, places, 2, 2, 512, COST, FAST)
    refined = [contiguous(8, 2) for _ in places]
    assert any(a.rank_of != b.rank_of for a, b in zip(refined, places))      # the case under test
    again = _plan_step(samples, refined, 2, 2, 512, COST, FAST, warm=first)
    assert again.packing is first.packing
    assert sorted(i for rank in again.cells for c in rank for i in c) == list(range(len(samples)))
    rescored = evaluate(first.cells, refined, samples, 2, COST)
    assert again.stats["start_energy"] == pytest.approx(rescored) and again.energy <= rescored + 1e-12
    w = warm_config(FAST)
    assert w.levels == max(1, FAST.levels // 2) and FAST.beta_lo < w.beta_lo < w.beta_hi == FAST.beta_hi
    plans = plan_window([samples], 2, 2, 512, COST, anneal_cfg=FAST)         # deterministic for a seed
    assert plans[0].cells == plan_window([samples], 2, 2, 512, COST, anneal_cfg=FAST)[0].cells


def test_migration_cost_charges_experts_and_changed_layers():
    from arbor.plan.placement import contiguous, from_ranks, refine
    from arbor.plan.routepack import migration_cost
    cur = [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]
    new = [from_ranks([0, 1, 0, 1], 2, np.ones(4)), from_ranks([0, 0, 1, 1], 2, np.ones(4)),
           from_ranks([1, 1, 0, 0], 2, np.ones(4))]
    assert migration_cost(new, cur, 0.5, 3.0) == pytest.approx(0.5 * 6 + 3.0 * 2)
    assert migration_cost(new, None, 0.5, 3.0) == 0.0
    with pytest.raises(ValueError, match="does not hold 2 experts"):
        from_ranks([0, 0, 0, 1], 2, np.ones(4))
    # refine: a swap that gains 20 rows pays 2 × 5 per expert, not 2 × 5 + a layer charge of 11
    X = np.array([[[40.0, 30, 20, 10]]])
    start = [contiguous(4, 2, X[0, 0])]
    assert refine(start, X, [start[0].rank_of], move_rows=5.0)[0].rank_of != [0, 0, 1, 1]
    assert refine(start, X, [start[0].rank_of], move_rows=5.0, layer_rows=11.0)[0].rank_of == [0, 0, 1, 1]
