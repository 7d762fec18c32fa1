"""``examples/openai-agent/run.sh`` end to end at smoke size (SFT, `arbor eval` and two `arbor train
agent=…` runs, each a subprocess): the example's pipeline runs as its README says."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_openai_agent_example_runs_at_smoke_size(tmp_path):
    env = {**os.environ, "SMOKE": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "examples/openai-agent/run.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_accuracy" in (tmp_path / "sft_eval.txt").read_text()
    for run in ("rl", "rl-rewrite"):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert rows and all(r["agent_episodes"] > 0 and r["samples"] >= r["agent_episodes"] for r in rows)
        assert sum(r["agent_dropped"] for r in rows) == 0 and "test_accuracy" in rows[-1]
    assert (tmp_path / "openai-agent.png").is_file()
    assert "rl-rewrite: held-out accuracy" in done.stdout
