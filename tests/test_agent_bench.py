"""``arbor bench rl --workload agent`` at its smallest settings: both paths train the same tokens and the
JSON carries the ratio as a target."""

import json

import pytest

from arbor.bench.rl_workloads import default_model
from arbor.cli import main


def test_bench_rl_agent_writes_the_ratio_target(tmp_path):
    model_dir = default_model(tmp_path / "model")
    args = ["bench", "rl", "--workload", "agent", "--out", str(tmp_path), "--model", str(model_dir), "--steps", "1",
            "--prompts", "1", "--threads", "1"]
    assert main(args) in (0, None)
    result = json.loads((tmp_path / "rl-agent.json").read_text())
    builtin, agent = result["builtin"], result["agent"]
    assert builtin["tokens_per_step"] == agent["tokens_per_step"] == 4 * 3 * 32    # 4 episodes × 3 turns × 32
    assert result["same_trained_tokens"] and agent["dropped"] == 0
    assert all(side["phases_s"]["rollout_s"] > 0 and side["step_s"] > 0 for side in (builtin, agent))
    [t] = result["targets"]
    assert t["value"] == pytest.approx(agent["step_s"] / builtin["step_s"], abs=1e-3) and t["target"] == "≤ 1.2"
    assert t["met"] == (agent["step_s"] / builtin["step_s"] <= 1.2)
    assert (tmp_path / "rl-agent.png").exists()
