"""`arbor train`'s plan.* keys: validation (each bad value names its key), the migration price from the
cost file."""

import json

import pytest

from arbor import configs
from arbor.train.config import RLConfig
from arbor.train.routepack_hook import PlanConfig


@pytest.mark.parametrize("word, key", [
    ("plan.tolerance=-0.1", "plan.tolerance"), ("plan.tolerance=nan", "plan.tolerance"),
    ("plan.tolerance=inf", "plan.tolerance"), ("plan.move_s=-1", "plan.move_s"), ("plan.move_s=nan", "plan.move_s"),
    ("plan.move_layer_s=-0.5", "plan.move_layer_s"), ("plan.cost_file=/nonexistent/cost.json", "plan.cost_file"),
    ("plan.window=0", "plan.window"), ("plan.layout=balanced", "plan.layout"), ('plan.tolerance="lots"', "plan.tolerance"), ("plan.move_s=true", "plan.move_s")])
def test_bad_plan_values_are_refused_naming_the_key(word, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        configs.load(RLConfig, None, [word])


def test_routepack_without_routing_replay_is_refused():
    with pytest.raises(ValueError, match="replay_routing"):
        configs.load(RLConfig, None, ["plan.routepack=true", "replay_routing=false"])


def test_plan_keys_load_and_default(tmp_path):
    cfg = configs.load(RLConfig, None, ["plan.tolerance=0.05", "plan.move_s=0.02", "plan.move_layer_s=0"])
    assert (cfg.plan.tolerance, cfg.plan.move_s, cfg.plan.move_layer_s) == (0.05, 0.02, 0.0)
    d = PlanConfig()
    assert d.layout == "auto" and d.window == 4 and d.tolerance == 0.0 and d.move_s is None and d.move_layer_s is None and d.cost_file == ""
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
