"""``arbor plan calibrate`` and ``arbor bench routepack`` end to end on a tiny MoE (ranks in child processes).

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import json

import numpy as np
import pytest

from arbor.cli import main
from arbor.plan.cost import nonneg_lstsq
from arbor.train.plan_calibrate_ep import ep_features, ep_slots

TINY = ["--hidden", "64", "--experts", "4", "--moe-intermediate", "64", "--layers", "2", "--vocab", "256"]


def test_calibrate_then_bench_routepack_smoke(tmp_path, capsys):
    cost = tmp_path / "cost.json"
    assert main(["plan", "calibrate", *TINY, "--repeats", "1", "--out", str(cost), "--ep", "--ep-slots", "6",
                 "--ep-max-tokens", "64"]) in (0, None)
    c = json.loads(cost.read_text())
    ep = c["meta"]["ep_fit"]                 # the step coefficients fitted on 2 EP ranks replace one process's
    fitted = nonneg_lstsq(np.array(ep["features"]), np.array(ep["seconds"]))
    assert np.allclose(fitted, [c["c0"], c["c1"], c["a"], c["b"], c["e"]]) and len(ep["seconds"]) == 2 * 6
    assert all(t > 0 for t in ep["seconds"]) and set(c["meta"]["one_process"]) == {"a", "b", "e", "c0", "c1"}
    assert all(c[k] >= 0 for k in ("a", "b", "e", "c0")) and c["meta"]["shape"]["num_experts"] == 4
    mig = c["meta"]["migration"]            # timed on 2 ranks: (layers changed, experts moved) → seconds
    assert c["move_s"] >= 0 and c["move_layer_s"] >= 0 and mig["points"] == [[1, 2], [1, 4], [2, 4], [2, 8]]
    assert len(mig["seconds"]) == 4 and all(t > 0 for t in mig["seconds"])
    # the stored prices are the non-negative fit of the recorded points (tiny migrations take a few ms,
    # so a slope may fit to 0 on a noisy run: the fit is checked, not the sign of the noise)
    fitted = nonneg_lstsq(np.array([[1.0, layers, m] for layers, m in mig["points"]]), np.array(mig["seconds"]))
    assert np.allclose(fitted, [mig["intercept_s"], c["move_layer_s"], c["move_s"]])
    assert main(["bench", "routepack", "--out", str(tmp_path), *TINY, "--windows", "3", "--samples", "16",
                 "--recorded-windows", "1", "--token-cap", "256", "--max-len", "256", "--measure-steps", "2",
                 "--window-steps", "1", "--step-samples", "8", "--repeats", "1", "--warmup", "0", "--population", "4",
                 "--levels", "3", "--sweeps", "8", "--cost-file", str(cost), "--timeout", "120"]) in (0, None)
    r = json.loads((tmp_path / "routepack.json").read_text())
    assert (tmp_path / "routepack.png").exists() and r["benchmark"] == "routepack"
    assert set(r["planner"]) == {"synthetic", "recorded"} and set(r["measured"]) == {"synthetic", "recorded"}
    for p in r["planner"].values():
        for w in p["windows"]:     # RoutePack never models worse than its own start; all methods planned
            assert set(w["energy"]) == {"token balance", "KK + static", "RoutePack"} and w["rows"] >= w["bound"]
            assert 0 < w["bound_s"] <= min(w["energy"].values()) + 1e-12           # the step's lower bound
        assert all(v >= 1 - 1e-12 for v in p["over_bound"].values())
        for method, v in p["over_bound"].items():       # Σ modeled seconds ÷ Σ lower bounds, over its windows
            want = sum(w["energy"][method] for w in p["windows"]) / sum(w["bound_s"] for w in p["windows"])
            assert v == pytest.approx(want, rel=1e-12)
    for m in r["measured"].values():
        assert all(v > 0 for v in m["tokens_per_s"].values()) and len(m["tokens_per_step"]) == 2
        assert all(0 < b <= e + 1e-12 for b, e in zip(m["modeled_bound_s"], m["modeled_step_s"]["RoutePack"]))
        assert len(m["window_migrations"]) == 1 and m["window_migrations"][0]["to_step"] == 1   # 2 windows of 1 step
        for method, tps in m["tokens_per_s"].items():   # measured tokens/s: Σ tokens ÷ Σ step seconds
            assert tps == pytest.approx(sum(m["tokens_per_step"]) / sum(m["step_s"][method]), rel=1e-12)
    syn = r["measured"]["synthetic"]["tokens_per_s"]
    assert r["targets"][0]["value"] == pytest.approx(syn["RoutePack"] / syn["KK + static"], rel=1e-12)
    assert [t["name"].split(",")[0] for t in r["targets"]][0] == "measured tokens/s"
    for t in r["targets"]:
        assert set(t) == {"name", "value", "target", "met"} and isinstance(t["met"], bool)
    assert r["config"]["move_s"] == c["move_s"] and r["config"]["move_layer_s"] == c["move_layer_s"]
    assert "targets" in capsys.readouterr().out


def test_bad_flags_exit_2_before_any_work(tmp_path, capsys):
    for flag in (["--move-s", "-0.1"], ["--move-tolerance", "nan"], ["--window-steps", "0"], ["--repeats", "0"],
                 ["--move-layer-s", "inf"]):
        assert main(["bench", "routepack", *TINY, "--out", str(tmp_path / "never"), *flag]) == 2
        assert flag[0] in capsys.readouterr().err
    for flags in (["--ep", "--ep-slots", "0"], ["--ep", "--ep-max-tokens", "8"], ["--ep-slots", "8"]):
        assert main(["plan", "calibrate", *TINY, "--out", str(tmp_path / "never" / "cost.json"), *flags]) == 2
        assert flags[-2] in capsys.readouterr().err       # named, and refused before anything is measured
    assert not (tmp_path / "never").exists()


def test_migration_targets_move_exactly_what_they_say():
    from arbor.train.plan_calibrate_ep import migration_points, migration_targets
    points = migration_points(4, 16)
    assert points == [(1, 2), (1, 4), (1, 8), (1, 16), (4, 8), (4, 16), (4, 32), (4, 64)]
    for (layers, M), rank_of in zip(points, migration_targets(16, 4, 2, points)):
        moved = [sum(r != e // 8 for e, r in enumerate(layer)) for layer in rank_of]
        assert sum(moved) == M and sum(m > 0 for m in moved) == layers
        assert all(sorted(layer) == [0] * 8 + [1] * 8 for layer in rank_of)
    with pytest.raises(ValueError, match="cannot move 3"):
        migration_targets(16, 4, 2, [(1, 3)])


def test_ep_slots_cover_both_ranks_and_every_routed_copy():
    """Every slot gives each rank a non-empty cell within the token budget; the routed rows of a slot
    over both ranks are every copy of its tokens (k per token and MoE layer), and they move with
    the placement: the design separates tokens from routed rows."""
    design = ep_slots(num_experts=4, moe_layers=2, top_k=2, max_tokens=64, count=8, seed=1)
    X = ep_features(design)
    assert X.shape == (16, 5) and (X[:, 1] >= 1).all() and (X[:, 2] <= 64).all()
    for s, slot in enumerate(design["cells"]):
        tokens = sum(design["lengths"][i] for cell in slot for i in cell)
        assert X[2 * s, 4] + X[2 * s + 1, 4] == 2 * 2 * tokens
    share = X[:, 4] / (2 * 2 * np.repeat(X[0::2, 2] + X[1::2, 2], 2))
    assert share.std() > 0.02 and np.linalg.matrix_rank(X) == 5


def test_bench_routepack_rl_trains_both_layouts_on_the_same_recorded_steps(tmp_path):
    """``arbor bench routepack-rl`` on a tiny MoE: two ``RLTrainer``s per rank train the same recorded
    steps; the figure is the median over windows of the per-window tokens/s ratio."""
    from arbor.plan import CostModel
    cost = CostModel(a=2e-5, b=1e-8, e=1e-5, c0=2e-3, move_s=1e-3, move_layer_s=5e-3).save(tmp_path / "cost.json")
    assert main(["bench", "routepack-rl", "--out", str(tmp_path), *TINY[:-2], "--windows", "2", "--warmup", "0",
                 "--repeats", "1", "--groups", "2", "--branch", "2", "--max-tokens", "16", "--token-cap", "256",
                 "--cost-file", str(cost), "--timeout", "240"]) in (0, None)
    r = json.loads((tmp_path / "routepack-rl.json").read_text())
    assert (tmp_path / "routepack-rl.png").exists() and r["benchmark"] == "routepack-rl"
    assert len(r["tokens"]) == 2 and all(n > 0 for n in r["tokens"])
    for k, n in enumerate(r["tokens"]):
        want = (n / r["step_s"]["RoutePack"][k]) / (n / r["step_s"]["KK + static"][k])
        assert r["ratio_per_window"][k] == pytest.approx(want, rel=1e-12)
    assert r["ratio_median"] == pytest.approx(float(np.median(r["ratio_per_window"])), rel=1e-12)
    assert "routepack_moved" in r["stats"]["RoutePack"] and "layout_s" in r["stats"]["KK + static"]
    assert r["stats"]["RoutePack"]["routepack_fallback"] == 0
    (t,) = r["targets"]
    assert t["target"] == ">= 1.10" and t["met"] == (t["value"] >= 1.10) and t["value"] == r["ratio_median"]
