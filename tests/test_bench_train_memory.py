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
    systems = ("float32", "bfloat16", "bfloat16+lora16")
    assert (tmp_path / "train-memory.png").exists()
    assert set(res) == {f"{s} [{m}]" for s in systems for m in ("tuned", "lean")}
    for one in res.values():
        assert len(one["step_s"]) == 2 and one["peak_rss_gib"] > 0 and len(one["loss"]) == 2
    tuned = {s: res[f"{s} [tuned]"] for s in systems}
    assert tuned["bfloat16"]["trainable"] == tuned["float32"]["trainable"] > 2 * tuned["bfloat16+lora16"]["trainable"]
    speed, lora_lean, plan_tuned, planned = r["targets"]       # the LoRA target is measured under lean
    assert plan_tuned["value"] == max(abs(tuned[s]["plan_gib"] / tuned[s]["peak_rss_gib"] - 1) for s in systems)
    assert speed["value"] == tuned["bfloat16"]["median_step_s"] / tuned["float32"]["median_step_s"]
    assert speed["met"] == (speed["value"] <= 0.8)
    assert "lean" in lora_lean["name"]
    assert lora_lean["value"] == res["bfloat16+lora16 [lean]"]["peak_rss_gib"] / res["float32 [lean]"]["peak_rss_gib"]
    assert lora_lean["met"] == (lora_lean["value"] <= 0.4)
    assert planned["value"] == max(abs(res[f"{s} [lean]"]["plan_gib"] / res[f"{s} [lean]"]["peak_rss_gib"] - 1)
                                   for s in systems)
