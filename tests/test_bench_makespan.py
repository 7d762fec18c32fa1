"""``arbor bench makespan`` end to end on tiny models: 1 rank × 2 cores and 2 EP ranks as child processes.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import json

import pytest

from arbor.cli import main


def test_bench_makespan_smoke(tmp_path, capsys):
    assert main(["bench", "makespan", "--out", str(tmp_path), "--configs", "1 rank MoE x 2 cores,2 ranks MoE (EP=2)",
                 "--trajectories", "4", "--turns", "2", "--prompt-tokens", "40-120", "--tool-tokens", "16-48",
                 "--output-tokens", "4-12", "--tool-median-ms", "20", "--hidden", "64", "--layers", "2",
                 "--experts", "4", "--vocab", "256", "--max-num-batched-tokens", "64", "--repeats", "1",
                 "--timeout", "90"]) in (0, None)
    r = json.loads((tmp_path / "makespan.json").read_text())
    assert (tmp_path / "makespan.png").exists() and r["benchmark"] == "makespan"
    two = r["results"]["2 ranks MoE (EP=2)"]
    for res in r["results"].values():
        assert res["same_outputs"]                        # every policy generated the same tokens
        for p in ("prefill-first", "mixed", "pd-global-enqueue", "pd-multiplex"):
            assert res[p]["median_makespan_s"] > 0 and res[p]["tokens_per_s"] > 0
            assert res[p]["ttft_continuation_p99_s"] >= res[p]["ttft_continuation_p50_s"] > 0
    assert len(two["pd-multiplex"]["timeline"]) == 2      # one per rank
    # pd-multiplex runs decode steps at the boundaries inside a prefill forward; the coarse baseline has none
    assert min(two["pd-multiplex"]["boundary_decode_steps"]) > 0 and two["pd-global-enqueue"]["boundary_decode_steps"] == [0, 0]
    assert r["args"]["pd_threads"] == "1,1"
    assert len(r["targets"]) == 4 and all(set(t) == {"name", "value", "target", "met"} for t in r["targets"])
    for t in r["targets"]:
        assert t["met"] == (t["value"] >= (0.10 if "prefill-first" in t["name"] else 0.05))
    for i, name in enumerate(["1 rank MoE x 2 cores", "2 ranks MoE (EP=2)"]):
        m = {p: r["results"][name][p]["median_makespan_s"] for p in ("prefill-first", "mixed", "pd-global-enqueue",
                                                                      "pd-multiplex")}
        ts = r["targets"][2 * i:2 * i + 2]
        assert all(name in t["name"] for t in ts)
        assert [t["value"] for t in ts] == pytest.approx(      # the cuts, from the makespans it reports
            [1 - m["pd-multiplex"] / m["prefill-first"], 1 - m["pd-multiplex"] / m["pd-global-enqueue"]], rel=1e-12)
        assert r["reported"][name]["pd_multiplex_over_mixed"] == pytest.approx(m["pd-multiplex"] / m["mixed"], rel=1e-12)
        assert set(r["reported"][name]) == {"pd_multiplex_over_mixed", "pd_multiplex_p99_ttft_over_prefill_first"}
    for res in r["results"].values():     # tokens/s x makespan: the tokens generated, the same for every policy
        generated = {p: res[p]["tokens_per_s"] * res[p]["median_makespan_s"] for p in m}
        assert all(g == pytest.approx(round(generated["mixed"]), rel=1e-9) for g in generated.values())
        assert 4 * 2 * 4 <= round(generated["mixed"]) <= 4 * 2 * 12        # 4 trajectories x 2 turns x 4-12 tokens
    assert "targets" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [(["--prompt-tokens", "9-3"], "LO <= HI"),
                                           (["--configs", "3 ranks"], "unknown ['3 ranks']"),
                                           (["--turns", "0"], "--turns must be >= 1"),
                                           (["--pd-threads", "1"], "--pd-threads: EngineConfig.pd_threads must be")])
def test_bench_makespan_refuses_bad_flags(tmp_path, capsys, args, message):
    try:
        code = main(["bench", "makespan", "--out", str(tmp_path), *args])
    except SystemExit as e:           # argparse: a bad value of a typed flag
        code = e.code
    assert code not in (0, None) and message in capsys.readouterr().err
