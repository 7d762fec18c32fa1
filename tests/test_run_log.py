"""One run logger for every job: metrics.jsonl with shared keys, one row per step after a resume."""

import json

import pytest

from arbor.cli import main as cli_main
from arbor.train.run_log import LogConfig, RunLog

SHARED = {"step", "loss", "lr", "grad_norm", "tokens", "seconds"}


def rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_sft_and_train_write_the_shared_keys_once_per_step(tmp_path):
    sft = tmp_path / "sft"
    assert cli_main(["sft", f"out={sft}", "demos=16", "train.batch_tokens=300", "train.log_every=1", "train.steps=2",
                     "log.progress=false"]) == 0
    assert [r["step"] for r in rows(sft)] == [0, 1] and all(SHARED <= r.keys() for r in rows(sft))
    assert json.loads((sft / "run_config.json").read_text())["train"]["steps"] == 2
    rl = tmp_path / "rl"
    words = [f"model={sft}", f"out={rl}", "groups_per_step=2", "rollout.max_turn_tokens=8", "rollout.branch=[2]",
             "c3po.enabled=false", "checkpoint_every=1", "log.progress=false"]
    assert cli_main(["train", "steps=2", *words]) == 0
    assert [r["step"] for r in rows(rl)] == [0, 1] and all(SHARED <= r.keys() for r in rows(rl))
    assert cli_main(["train", "steps=3", *words]) == 0                  # resumed: appends step 2 only
    assert [r["step"] for r in rows(rl)] == [0, 1, 2]


def test_a_log_opened_at_a_step_drops_the_rows_from_it_on(tmp_path):
    log = RunLog(tmp_path, {"x": 1}, 4, LogConfig(progress=False)).start()
    for step in range(4):
        log.log({"step": step, "loss": 1.0})
    log.close()
    again = RunLog(tmp_path, {"x": 1}, 4, LogConfig(progress=False)).start(2)   # a resume from step 2
    again.log({"step": 2, "loss": 0.5})
    again.close()
    assert [(r["step"], r["loss"]) for r in rows(tmp_path)] == [(0, 1.0), (1, 1.0), (2, 0.5)]
    RunLog(tmp_path, None, 4, LogConfig(progress=False)).start(0).close()      # a fresh run starts a fresh file
    assert rows(tmp_path) == []


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log = RunLog(tmp_path, {"x": 1}, 2, LogConfig(progress=False, wandb=True)).start()
    log.log({"step": 0, "loss": 1.0})
    log.close()
    assert (tmp_path / "wandb").exists()
