"""``arbor bench train-memory`` end to end at a tiny shape: each system runs in its own process, the
figures and targets are computed from the run."""

import json

from arbor.cli import main


def test_bench_train_memory_smoke(tmp_path):
    assert main(["bench", "train-memory", "--out", str(tmp_path), "--hidden", "64", "--intermediate", "128", "--layers", "2",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "256", "--tokens", "512",
                 "--steps", "2"]) in (0, None)
    r = json.loads((tmp_path / "train-memory.json").read_text())
    res = r["results"]
    assert (tmp_path / "train-memory.png").exists() and set(res) == {"float32", "bfloat16", "bfloat16+lora16"}
    for one in res.values():
        assert len(one["step_s"]) == 2 and one["peak_rss_gib"] > 0 and len(one["loss"]) == 2
    assert res["bfloat16"]["trainable"] == res["float32"]["trainable"] > 2 * res["bfloat16+lora16"]["trainable"]
    speed, lora, planned = r["targets"]
    assert planned["value"] == max(abs(x["plan_gib"] / x["peak_rss_gib"] - 1) for x in res.values())   # SFT systems only
    assert speed["value"] == res["bfloat16"]["median_step_s"] / res["float32"]["median_step_s"]
    assert speed["met"] == (speed["value"] <= 0.8)
    assert lora["value"] == res["bfloat16+lora16"]["peak_rss_gib"] / res["float32"]["peak_rss_gib"]
    assert lora["met"] == (lora["value"] <= 0.4)
