"""``arbor bench train-memory`` end to end at a tiny shape: both dtypes run in their own processes, the
figures and targets are computed from the run."""

import json

from arbor.cli import main


def test_bench_train_memory_smoke(tmp_path):
    assert main(["bench", "train-memory", "--out", str(tmp_path), "--hidden", "64", "--intermediate", "128", "--layers", "2",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "256", "--tokens", "512",
                 "--steps", "2"]) in (0, None)
    r = json.loads((tmp_path / "train-memory.json").read_text())
    assert (tmp_path / "train-memory.png").exists() and set(r["results"]) == {"float32", "bfloat16"}
    for res in r["results"].values():
        assert len(res["step_s"]) == 2 and res["peak_rss_gib"] > 0 and len(res["loss"]) == 2
    speed, lora = r["targets"]
    assert speed["value"] == r["results"]["bfloat16"]["median_step_s"] / r["results"]["float32"]["median_step_s"]
    assert speed["met"] == (speed["value"] <= 0.8) and lora["met"] is False
