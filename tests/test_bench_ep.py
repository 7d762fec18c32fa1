"""``arbor bench ep`` end to end on a tiny MoE: 2 EP ranks and the 1-rank baseline as child processes.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import json
from statistics import median

import pytest

from arbor.cli import main


def test_bench_ep_smoke(tmp_path, capsys):
    assert main(["bench", "ep", "--out", str(tmp_path), "--hidden", "64", "--experts", "4", "--moe-intermediate", "64",
                 "--layers", "1", "--vocab", "256", "--batch", "4", "--seq-len", "32", "--prompts", "4",
                 "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1", "--timeout", "60"]) in (0, None)
    r = json.loads((tmp_path / "ep.json").read_text())
    assert (tmp_path / "ep.png").exists()
    assert r["benchmark"] == "ep" and r["config"]["ranks"] == 2
    for k in ("single", "ep"):
        assert r["train"][k]["tokens_per_s"] > 0 and r["decode"][k]["decode_tokens_per_s"] > 0
        assert r["train"][k]["tokens"] == 4 * 32 and r["decode"][k]["decode_tokens"] == 4 * 3
        assert all(b > 0 for b in r["memory"][k]["train"]["maxrss_bytes"])
    assert r["memory"]["single"]["train"]["threads"] == 2 and r["memory"]["ep"]["train"]["threads"] == 1
    assert len(r["memory"]["ep"]["train"]["maxrss_bytes"]) == 2
    assert r["train"]["single"]["all_to_all_share"] == [0.0]
    assert all(0 < s < 1 for s in r["train"]["ep"]["all_to_all_share"])
    assert r["train"]["ep"]["a2a_calls_per_step"] == 5        # forward: counts + rows out + rows back; backward: 2
    # the same computation on both: experts split in halves, same first loss
    assert r["expert_share_per_rank"] == [0.5, 0.5]
    # float32 mean of 124 cross-entropies ≈ 5.6, summed in another order over 2 ranks: pairwise summation is off by
    # ≤ log2(124)·2^-24·5.6 ≈ 2.3e-6 on each side; 3e-5 ≈ 10× that (measured 2.4e-7, AVX-512, AVX2 and kernels off)
    assert r["checks"]["first_step_loss_abs_diff"] < 3e-5
    assert r["checks"]["decode_same_tokens_fraction"] == 1.0   # greedy: both generated the same tokens
    for k in ("single", "ep"):   # throughputs and their ratios from the times the JSON reports (float64 rounding)
        t = r["train"][k]
        assert t["median_step_s"] == median(t["step_s"])
        assert t["tokens_per_s"] == pytest.approx(t["tokens"] / t["median_step_s"], rel=1e-12)
    assert r["ratios"]["train_tokens_per_s"] == pytest.approx(
        r["train"]["ep"]["tokens_per_s"] / r["train"]["single"]["tokens_per_s"], rel=1e-12) == r["targets"][0]["value"]
    names = [t["name"] for t in r["targets"]]
    assert len(names) == 2 and names[0].startswith("train tokens/s")
    for t in r["targets"]:
        assert set(t) == {"name", "value", "target", "met"} and isinstance(t["met"], bool)
    assert r["targets"][1]["met"] and r["targets"][1]["value"] == 0.5
    assert r["targets"][0]["met"] == (r["ratios"]["train_tokens_per_s"] >= 0.8)
    assert "targets" in capsys.readouterr().out
