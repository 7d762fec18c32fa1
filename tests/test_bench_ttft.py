"""``arbor bench ttft`` end to end on a tiny trace (request-level vs layer-wise vs layer-wise + SLO).

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import json

import pytest

from arbor.cli import main


def test_bench_ttft_smoke(tmp_path, capsys):
    assert main(["bench", "ttft", "--out", str(tmp_path), "--requests", "5", "--rate", "1000", "--prompt-tokens",
                 "64-256", "--output-tokens", "4-8", "--layers", "4", "--hidden", "32", "--vocab", "128",
                 "--max-num-batched-tokens", "128", "--repeats", "2"]) in (0, None)
    r = json.loads((tmp_path / "ttft.json").read_text())
    assert (tmp_path / "ttft.png").exists() and r["benchmark"] == "ttft"
    assert set(r["results"]) == {"request-level", "layer-wise", "layer-wise+slo"}
    for name, res in r["results"].items():
        assert res["ttft_p99_s"] >= res["ttft_p50_s"] > 0 and res["throughput_tok_s"] > 0
        assert 0 <= res["slo_violation_rate"] <= 1 and 0 < res["mean_occupancy"] <= 1
    lw = r["results"]["layer-wise"]          # a burst: the device tier cannot keep every layer of all five
    assert lw["offload_bytes"] > 0 and lw["prefetch_bytes"] > 0 and 0 <= lw["overlap"] <= 1
    assert all(set(t) == {"name", "value", "target", "met"} for t in r["targets"])
    assert r["targets"][-1]["met"]                      # greedy outputs identical across the systems
    assert set(r["missed"]) == {t["name"] for t in r["targets"] if not t["met"]}   # each with its measured figures
    assert r["repeats"] == len(r["rounds"]) == 2
    for system, res in r["results"].items():         # medians of the rounds (of two: the mean), spread [min, max]
        for key, (lo, hi) in r["spread"][system].items():
            runs = [rd["results"][system][key] for rd in r["rounds"]]
            assert (lo, hi) == (min(runs), max(runs)) and res[key] == pytest.approx(sum(runs) / 2, rel=1e-12)
    for i, system in enumerate(("layer-wise", "layer-wise+slo")):   # the targets, from the figures of each round
        ratio, cost = [], []
        for rd in r["rounds"]:
            req, res = rd["results"]["request-level"], rd["results"][system]
            ratio.append(req["ttft_p99_s"] / res["ttft_p99_s"])
            cost.append(1 - res["throughput_tok_s"] / req["throughput_tok_s"])
        assert r["target_runs"][r["targets"][3 * i]["name"]] == pytest.approx(ratio, rel=1e-12)
        assert r["targets"][3 * i]["value"] == pytest.approx(sum(ratio) / 2, rel=1e-12)
        assert r["targets"][3 * i + 1]["value"] == pytest.approx(sum(cost) / 2, rel=1e-9, abs=1e-12)
    # throughput x makespan: the tokens generated, the same for every system (5 requests x 4-8 tokens)
    generated = [res["throughput_tok_s"] * res["makespan_s"] for res in r["rounds"][0]["results"].values()]
    assert all(g == pytest.approx(round(generated[0]), rel=1e-9) for g in generated) and 20 <= round(generated[0]) <= 40
    assert "targets" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [(["--prompt-tokens", "9-3"], "LO <= HI"),
                                           (["--requests", "0"], "--requests must be >= 1"),
                                           (["--device-requests", "0.5"], "--device-requests must be >= 1"),
                                           (["--repeats", "0"], "--repeats must be >= 1"),
                                           (["--slo-safety", "0.9"], "--slo-safety must be >= 1")])
def test_bench_ttft_refuses_bad_flags(tmp_path, capsys, args, message):
    try:
        code = main(["bench", "ttft", "--out", str(tmp_path), *args])
    except SystemExit as e:           # argparse: a bad value of a typed flag
        code = e.code
    except ValueError as e:
        assert message in str(e)
        return
    assert code != 0 and message in capsys.readouterr().err
