"""`arbor demo` end to end at a toy size: SFT stops at the accuracy check, RL runs, results are written."""

import json

from arbor import configs
from arbor.train.demo import DemoConfig, demo


def test_demo_stops_sft_at_the_check_then_runs_rl_and_writes_results(tmp_path):
    cfg = configs.load(DemoConfig, None, [
        f'out="{tmp_path}"', "eval_problems=4", "sft_target=0.0", "sft_check_every=3", "sft_check_problems=2",
        "sft.demos=24", "sft.train.steps=50", "sft.train.batch_tokens=600", "sft.train.log_every=100",
        "rl.steps=1", "rl.eval_every=0", "rl.checkpoint_every=0", "rl.c3po.token_budget=200", "rl.c3po.capacity=4",
        "rl.rollout.branch=[2]", "rl.rollout.max_turn_tokens=8"])
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "stale").write_text("from an earlier run")
    result = demo(cfg)
    sft_history = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert sft_history[-1]["step"] == 2                # target 0 is met at the first check, after step 3
    assert not (tmp_path / "rl" / "stale").exists()
    assert json.loads((tmp_path / "demo.json").read_text()) == result
    assert 0.0 <= result["accuracy_before"] <= 1.0 and 0.0 <= result["accuracy_after"] <= 1.0
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert (tmp_path / "rl" / "metrics.jsonl").read_text().count("\n") >= 1
