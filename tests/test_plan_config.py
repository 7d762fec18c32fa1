"""`arbor train`'s plan.* keys: validation (each bad value names its key), the migration price from the
cost file, and the trainer's window placement under that price (no ranks: the numpy part).

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import json

import numpy as np
import pytest

from arbor import configs
from arbor.models.expert_parallel import ExpertPlacement
from arbor.train.config import RLConfig
from arbor.train.routepack_hook import PlanConfig, window_placements


@pytest.mark.parametrize("word, key", [
    ("plan.tolerance=-0.1", "plan.tolerance"), ("plan.tolerance=nan", "plan.tolerance"),
    ("plan.tolerance=inf", "plan.tolerance"), ("plan.move_s=-1", "plan.move_s"), ("plan.move_s=nan", "plan.move_s"),
    ("plan.move_layer_s=-0.5", "plan.move_layer_s"), ("plan.cost_file=/nonexistent/cost.json", "plan.cost_file"),
    ("plan.window=0", "plan.window"), ('plan.tolerance="lots"', "plan.tolerance"), ("plan.move_s=true", "plan.move_s")])
def test_bad_plan_values_are_refused_naming_the_key(word, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        configs.load(RLConfig, None, [word])


def test_plan_keys_load_and_default(tmp_path):
    cfg = configs.load(RLConfig, None, ["plan.tolerance=0.05", "plan.move_s=0.02", "plan.move_layer_s=0"])
    assert (cfg.plan.tolerance, cfg.plan.move_s, cfg.plan.move_layer_s) == (0.05, 0.02, 0.0)
    d = PlanConfig()
    assert d.tolerance == 0.0 and d.move_s is None and d.move_layer_s is None and d.cost_file == ""
    assert "plan.tolerance" in configs.help_text(RLConfig) and "plan.move_s" in configs.help_text(RLConfig)


def test_migration_price_comes_from_the_cost_file_unless_set(tmp_path, monkeypatch):
    monkeypatch.setenv("ARBOR_CACHE", str(tmp_path / "empty-cache"))           # no default cost file
    assert PlanConfig().migration_price() == (0.0, 0.0, pytest.approx(1e-4))  # built-in e, no price
    f = tmp_path / "cost.json"
    f.write_text(json.dumps({"a": 1e-4, "b": 1e-7, "e": 5e-5, "c0": 0.05, "move_s": 0.004, "move_layer_s": 0.025}))
    cfg = configs.load(RLConfig, None, [f"plan.cost_file={json.dumps(str(f))}"])
    assert cfg.plan.migration_price() == (0.004, 0.025, 5e-5)
    cfg = configs.load(RLConfig, None, [f"plan.cost_file={json.dumps(str(f))}", "plan.move_s=0.1"])
    assert cfg.plan.migration_price() == (0.1, 0.025, 5e-5)


def test_window_placements_pay_for_their_moves():
    contiguous = {m: ExpertPlacement.contiguous(4, 2) for m in range(2)}
    total = np.array([[40.0, 30, 20, 10], [10.0, 10, 10, 10]])     # layer 0: ranks 70 / 30; layer 1 balanced
    free, before, after = window_placements(total, contiguous)
    assert sorted(free[0].rank_of) == [0, 0, 1, 1] and free[1].rank_of == [0, 0, 1, 1]
    assert np.bincount(free[0].rank_of, total[0], 2).max() == 50 and before[0] == pytest.approx(1.4)
    assert after[0] == pytest.approx(1.0) and free[0].rank_of != contiguous[0].rank_of
    # the swap gains 70 − 50 = 20 rows of e = 1 s: moving 2 experts at 5 s each pays, at 11 s each it does not
    paid, _, _ = window_placements(total, contiguous, move_s=5.0, e=1.0)
    assert paid[0].rank_of == free[0].rank_of
    kept, _, after = window_placements(total, contiguous, move_s=11.0, e=1.0)
    assert kept[0].rank_of == [0, 0, 1, 1] and after[0] == pytest.approx(1.4)
    kept, _, _ = window_placements(total, contiguous, move_s=1.0, move_layer_s=19.0, e=1.0)   # 2 + 19 > 20
    assert kept[0].rank_of == [0, 0, 1, 1]
    # within the tolerance of the optimum nothing moves even for free
    tol, _, _ = window_placements(np.array([[26.0, 25, 25, 24], [1, 1, 1, 1]]), contiguous, tolerance=0.05)
    assert [p.rank_of for p in tol.values()] == [[0, 0, 1, 1], [0, 0, 1, 1]]
