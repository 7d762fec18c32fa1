"""Every benchmark runs end to end at its smallest settings and writes a non-empty ``targets`` list
of {name, value, target, met} computed from the run (the figures themselves are README material)."""

import json
import operator
import re
from statistics import median

import pytest

from arbor.bench import model as model_bench
from arbor.cli import BENCHMARKS, main

SMALL = {
    "model": ["--batch", "1", "--seq-len", "32", "--repeats", "1"],
    "engine": ["--batch", "2", "--new-tokens", "4", "--mixed", "4", "--repeats", "1"],
    "tree": ["--trees", "1", "--prompt", "16", "--turns", "1", "--repeats", "1", "--models", "dense"],
    "rl": ["--repeats", "1", "--prompts", "1", "--trl", "off"],
    "c3po": ["--groups", "2", "--samples", "8"],
    "mismatch": ["--steps", "2", "--seeds", "1", "--groups", "2", "--max-tokens", "24", "--model", "tiny",
                 "--eval-every", "1", "--eval-prompts", "2"],
}   # dllm trains its models for minutes: its targets are checked below on a real evaluation of a tiny model
# (mismatch: its context is max_tokens + 64 and a longtail prompt is 79 tokens, so --max-tokens 8 sampled nothing)

SAME = dict(rel=1e-12)   # a figure recomputed here by the bench's own formula: equal up to float64 rounding


def model_figures(r):
    for s in r["systems"].values():
        t = {k: median(v) for k, v in s["seconds"].items()}
        assert s["median_s"] == t
        assert s["ratio_arbor_over_transformers"] == pytest.approx(t["arbor"] / t["transformers"], **SAME)
        assert s["tokens_per_s"]["arbor"] == pytest.approx(1 * 32 / t["arbor"], **SAME)          # --batch 1 --seq-len 32
        assert s["speedup_over_transformers"] == pytest.approx(t["transformers"] / t["arbor"], **SAME)
    # the tiny shapes: Arbor's time ÷ transformers'; the real-sparsity ones: transformers' ÷ Arbor's, then
    # per dtype the moe64 ÷ moe32 cost of Arbor
    expected = [s["ratio_arbor_over_transformers"] if key.split("/")[0] in ("qwen3", "qwen3_moe")
                else s["speedup_over_transformers"] for key, s in r["systems"].items()]
    for dtype in model_bench.DTYPES:
        a, b = r["systems"].get(f"moe32/{dtype}"), r["systems"].get(f"moe64/{dtype}")
        if a and b:
            expected.append(b["median_s"]["arbor"] / a["median_s"]["arbor"])
    assert len(expected) > len(r["systems"])
    assert [t["value"] for t in r["targets"]] == pytest.approx(expected, **SAME)


def engine_figures(r):
    tps = r["tokens_per_s"]
    for key, secs in r["seconds"].items():
        w = r["config"]["workloads"][key.split()[0]]
        for system, times in secs.items():
            assert tps[key][system] == pytest.approx(w["requests"] * w["new_tokens"] / median(times), **SAME)
    assert r["fp32_greedy_equal_share"] == {"batch2 arbor=transformers": 1.0, "mixed4 arbor=transformers": 1.0}
    got = {t["name"]: t["value"] for t in r["targets"]}
    for d in ("fp32", "bf16"):
        want = tps[f"batch2 {d}"]["arbor"] / tps[f"batch2 {d}"]["transformers"]
        assert got[f"batch2: Arbor / transformers, {d}"] == pytest.approx(want, **SAME)


def tree_figures(r):
    ideal = r["trees"]["total_tokens"] / r["trees"]["compact_tokens"]
    assert r["trees"]["ideal_speedup"] == pytest.approx(ideal, **SAME)
    for s in r["systems"].values():
        t = {k: median(v) for k, v in s["seconds"].items()}
        assert s["median_s"] == t and s["speedup"] == pytest.approx(t["trajectory"] / t["tree"], **SAME)
        assert s["speedup_over_ideal"] == pytest.approx(s["speedup"] / ideal, **SAME)
    assert [t["value"] for t in r["targets"]] == [s["speedup_over_ideal"] for s in r["systems"].values()]


def rl_figures(r):
    for w in r["workloads"].values():
        a = w["arbor"]
        assert a["tokens_per_s"] == pytest.approx(a["tokens_per_step"] / a["step_s"], **SAME)
        assert a["tokens_per_step"] == median(h["tokens"] for h in a["history"])
        assert all(h["tokens"] == h["finished_tokens"] for h in a["history"])    # every finished model token trained


def c3po_figures(r):
    for s in r["systems"].values():
        h = s["history"]
        assert s["samples"] == sum(x["samples"] for x in h) >= 8                    # --samples 8
        assert s["rollout_s_total"] == pytest.approx(sum(x["rollout_s"] for x in h), **SAME)
        assert s["rollout_s_per_sample"] == pytest.approx(s["rollout_s_total"] / s["samples"], **SAME)
        assert all(x["tokens"] == x["finished_tokens"] for x in h)
    assert all(x["finished_tokens"] >= r["config"]["token_budget"] for x in r["systems"]["c3po++"]["history"])
    sync, c3po = (r["systems"][k]["rollout_s_per_sample"] for k in ("synchronous", "c3po++"))
    assert r["rollout_speedup_per_sample"] == pytest.approx(sync / c3po, **SAME) == r["targets"][0]["value"]
    assert r["targets"][1]["met"] == (abs(r["targets"][1]["value"]) <= 0.05)      # "within ± 0.05 (noise)"


def mismatch_figures(r):
    runs = r["runs"]
    tol = r["config"]["drop_tol"]
    for run in (x for rs in runs.values() for x in rs):
        # the engine samples in bfloat16 with Cauchy(2) logit noise on 20 % of positions; the trainer is float32
        assert min(run["mismatch_abs"]) > 0.1 and min(run["entropy"]) > 0
        q, h, he, ent, mis = 1, run["heldout_reward"], run["heldout_reward_engine"], run["entropy"], run["mismatch_abs"]
        assert run["heldout_steps"] == [0, 1, 2] and len(h) == len(he) == 3      # the docstring's rule, 2 steps
        assert run["heldout_drop"] == max(h) - h[-1] and run["falls"] == (max(h) - h[-1] >= tol)
        assert run["heldout_engine_drop"] == max(he) - he[-1] and run["falls_engine"] == (max(he) - he[-1] >= tol)
        assert run["entropy_ratio"] == pytest.approx(median(ent[-q:]) / ent[0], **SAME)
        assert run["mismatch_growth"] == pytest.approx(median(mis[-q:]) / median(mis[:q]), **SAME)
        assert run["mismatch_nan_steps"] == 0
    # step 0 is the same model for every correction: its held-out reward is the policy's, whatever the sampler
    assert len({x["heldout_reward"][0] for rs in runs.values() for x in rs}) == 1
    final = {c: median([x["heldout_final"] for x in runs[c]]) for c in ("none", "icepop")}
    growth = {c: median([x["mismatch_growth"] for x in runs[c]]) for c in ("none", "icepop")}
    falls = [sum(x[k] for x in runs[c]) for k in ("falls", "falls_engine") for c in ("none", "icepop")]
    values = falls + [final["icepop"] - final["none"], growth["none"] / growth["icepop"]]
    assert [t["value"] for t in r["targets"]] == pytest.approx(values, **SAME)
    assert [t["met"] for t in r["targets"]] == [values[0] >= 1, values[1] == 0, values[2] >= 1, values[3] == 0,
                                                 values[4] > 0, values[5] > 1]   # 1 seed


def test_mismatch_heldout_reward_ignores_the_noisy_sampler(one_thread):
    """The held-out reward is the policy's greedy reward: a trainer whose bfloat16 engine adds huge logit
    noise gets the same held-out reward (float32, and as served in bfloat16) as one with a clean engine,
    while evaluating through that noisy engine itself gives another one."""
    import asyncio
    import dataclasses
    from argparse import ArgumentParser

    from arbor.bench import mismatch
    from arbor.bench.rl_setup import make_trainer, tiny_model
    from arbor.train.rl_eval import evaluate_rows
    p = ArgumentParser()
    mismatch.add_arguments(p)
    a = p.parse_args(["--model", "tiny", "--groups", "1", "--max-tokens", "24", "--eval-prompts", "4"])
    a.device = "cpu"
    model, tok = tiny_model("tiny", seed=0)
    trainers = {}
    for noise in (0.0, 100.0):
        cfg = mismatch.rl_config("none", 0, a)
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, logit_noise=noise, logit_noise_frac=1.0))
        trainers[noise] = make_trainer(cfg, model, tok)
    clean, noisy = (mismatch.heldout_evaluator(trainers[n])() for n in (0.0, 100.0))
    through_noise, _ = asyncio.run(evaluate_rows(trainers[100.0], trainers[100.0].task.eval[:4], samples=1))
    assert clean == noisy
    assert through_noise["eval_reward"] != clean
    # as served: the bfloat16 engine's numerics without its noise
    served = [mismatch.heldout_evaluator(trainers[n], "bfloat16")() for n in (0.0, 100.0)]
    assert served[0] == served[1]


FIGURES = {"model": model_figures, "engine": engine_figures, "tree": tree_figures, "rl": rl_figures,
           "c3po": c3po_figures, "mismatch": mismatch_figures}
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}


def met_by_its_target(t):
    """``met`` of a target written "OP NUMBER" (a comparison that did not run: value None, not met);
    None for another form (those are checked per bench)."""
    m = re.fullmatch(r"(>=|<=|==|>|<) (-?[0-9.]+)", t["target"])
    return None if m is None else t["value"] is not None and OPS[m[1]](t["value"], float(m[2]))


def test_every_bench_has_help(capsys):
    for name in BENCHMARKS:
        with pytest.raises(SystemExit) as e:
            main(["bench", name, "--help"])
        assert e.value.code == 0 and f"arbor bench {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(SMALL))
def test_bench_writes_targets(tmp_path, name, one_thread, capsys):
    assert main(["bench", name, "--out", str(tmp_path), *SMALL[name]]) in (0, None)
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["targets"], name
    for t in result["targets"]:
        assert set(t) == {"name", "value", "target", "met"} and isinstance(t["met"], bool)
        assert met_by_its_target(t) in (None, t["met"]), t
    FIGURES[name](result)
    assert (tmp_path / f"{name}.png").exists()


def test_dllm_targets_from_a_real_evaluation():
    """The dllm bench's target entries, from its own evaluate/aup/targets on a tiny (untrained) model
    standing in for every model of the comparison."""
    import torch

    from arbor.bench.dllm import SWEEP, aup, evaluate, target_list, targets
    from arbor.dllm.decoding import DecodeConfig, quality, speed
    from arbor.models.tokenizer import builtin_tokenizer
    from arbor.tasks import addition
    from arbor.dllm.sft import build_model
    from tests.test_diffusion_bench import TINY
    tok = builtin_tokenizer()
    model = build_model(tok, TINY, seed=1).eval()
    problems = addition.generate(3, seed=0, split="test")
    with torch.no_grad():
        q, s = (evaluate(model, tok, "addition", problems, cfg(block_size=8)) for cfg in (quality, speed))
        curve = [evaluate(model, tok, "addition", problems, DecodeConfig(method="threshold", threshold=t)) for t in SWEEP]
    y_max = max(1e-9, max(p["accuracy"] for p in curve))
    a = aup([(p["tpf"], p["accuracy"]) for p in curve], y_max)
    entries = target_list("addition", targets(q, s, {"base": a, "TAD-Speed": a}, {"base": curve}, y_max))
    assert [e["target"] for e in entries] == [">= 2", ">= 1.5"]
    assert all(set(e) == {"name", "value", "target", "met"} for e in entries)
