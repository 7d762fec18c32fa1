"""Every benchmark runs end to end at its smallest settings and writes a non-empty ``targets`` list
of {name, value, target, met} computed from the run (the figures themselves are README material)."""

import json

import pytest

from arbor.cli import BENCHMARKS, build_parser, main

SMALL = {
    "model": ["--batch", "1", "--seq-len", "32", "--repeats", "1"],
    "engine": ["--batch", "2", "--new-tokens", "4", "--mixed", "4", "--repeats", "1"],
    "tree": ["--trees", "1", "--prompt", "16", "--turns", "1", "--repeats", "1", "--models", "dense"],
    "rl": ["--repeats", "1", "--prompts", "1", "--trl", "off"],
    "c3po": ["--groups", "2", "--samples", "8"],
    "mismatch": ["--steps", "2", "--seeds", "1", "--groups", "2", "--max-tokens", "8", "--model", "tiny"],
}   # dllm trains its models for minutes: its targets are checked below on a real evaluation of a tiny model


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
    assert (tmp_path / f"{name}.png").exists()


def test_dllm_targets_from_a_real_evaluation():
    """The dllm bench's target entries, from its own evaluate/aup/targets on a tiny (untrained) model
    standing in for every model of the comparison."""
    import torch

    from arbor.bench.dllm import SWEEP, aup, evaluate, target_list, targets
    from arbor.engine.diffusion import DecodeConfig, quality, speed
    from arbor.models.tokenizer import builtin_tokenizer
    from arbor.tasks import addition
    from arbor.train.diffusion import build_model
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
