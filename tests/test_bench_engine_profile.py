"""``arbor bench engine-profile`` on a few requests: timed phases that do not overlap, operators listed."""

import json

from arbor.cli import main


def test_engine_profile_smoke(tmp_path):
    assert main(["bench", "engine-profile", "--out", str(tmp_path), "--requests", "6", "--new-tokens", "4",
                 "--prompt-tokens", "8", "40", "--top-ops", "5"]) in (0, None)
    r = json.loads((tmp_path / "engine-profile.json").read_text())
    assert (tmp_path / "engine-profile.png").exists() and r["targets"] == []
    assert r["phases_s"]["engine loop, bookkeeping"] >= 0         # the timed phases never overlap
    assert r["phases_s"]["model forward + logits"] > 0 and r["phases_s"]["attention metadata"] > 0
    assert len(r["ops"]) == 5 and r["ops"][0]["seconds"] >= r["ops"][-1]["seconds"]
    gemms = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"}  # oneDNN-packed copy, or plain MKL
    assert any(o["op"] in gemms for o in r["ops"])
