"""``arbor bench lora`` end to end at a tiny size: both ways of rolling out a LoRA policy run, and the
figures and the target are computed from the run."""

import json

from arbor.cli import main


def test_bench_lora_smoke(tmp_path, one_thread):
    assert main(["bench", "lora", "--out", str(tmp_path), "--steps", "2", "--rounds", "1", "--groups", "2",
                 "--rank", "2"]) in (0, None)
    r = json.loads((tmp_path / "lora.json").read_text())
    assert (tmp_path / "lora.png").exists() and set(r["results"]) == {"merged", "in-forward"}
    merged, forward = r["results"]["merged"], r["results"]["in-forward"]
    assert merged["sync_s"] > 0 and forward["sync_s"] == 0        # merged sends W + s·BA; in-forward sends nothing
    (t,) = r["targets"]
    assert t["value"] == merged["step_s"] / forward["step_s"] and t["met"] == (t["value"] <= 1.0)
