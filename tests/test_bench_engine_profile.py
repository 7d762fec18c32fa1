"""``arbor bench engine-profile`` on a few requests: timed phases that do not overlap, operators listed.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import json

import pytest

from arbor.cli import main


def test_engine_profile_smoke(tmp_path):
    assert main(["bench", "engine-profile", "--out", str(tmp_path), "--requests", "6", "--new-tokens", "4",
                 "--prompt-tokens", "8", "40", "--top-ops", "5"]) in (0, None)
    r = json.loads((tmp_path / "engine-profile.json").read_text())
    assert (tmp_path / "engine-profile.png").exists() and r["targets"] == []
    assert r["phases_s"]["engine loop, bookkeeping"] >= 0         # the timed phases never overlap
    assert r["phases_s"]["model forward + logits"] > 0 and r["phases_s"]["attention metadata"] > 0
    assert len(r["ops"]) == 5 and r["ops"][0]["seconds"] >= r["ops"][-1]["seconds"]
    # the phases split the timed pass; its tokens: 6 requests x 4 new tokens (float64 rounding only)
    assert sum(r["phases_s"].values()) == pytest.approx(r["wall_s"], rel=1e-9)
    assert r["tokens_per_s"] * r["wall_s"] == pytest.approx(6 * 4, rel=1e-12)
    totals = [o["seconds"] / o["share"] for o in r["ops"]]        # every share is of the same profiled total
    assert max(totals) == pytest.approx(min(totals), rel=1e-9)
    gemms = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"}  # oneDNN-packed copy, or plain MKL
    assert any(o["op"] in gemms for o in r["ops"])
