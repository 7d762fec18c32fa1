"""Multi-rank runtime: every rank runs in a child process (tests/dist_cases.py) under a hard timeout."""

import sys
import time
from pathlib import Path

import pytest
import torch

from arbor.dist.launch import launch

CASES = str(Path(__file__).with_name("dist_cases.py"))


def run_case(tmp_path, *args, timeout=60, env=None):
    result = launch([sys.executable, CASES, args[0], str(tmp_path), *args[1:]], 2, threads=1, timeout_s=timeout,
                    echo=None, grace_s=5, env=env)
    return result, "\n".join(f"[rank {r}] {line}" for r in range(2) for line in result.output[r])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_ep_forward_and_gradients_equal_one_process(tmp_path, dtype):
    result, text = run_case(tmp_path, "ep_grad", dtype)
    assert result.returncode == 0, text


def test_distributed_engine_greedy_equals_one_process(tmp_path):
    result, text = run_case(tmp_path, "engine")
    assert result.returncode == 0, text
    assert "5 requests, equal: True" in text and "2 requests, equal: True" in text


def test_crossed_collective_raises_tag_error_on_both_ranks(tmp_path):
    result, text = run_case(tmp_path, "crossed")
    assert result.returncode == 0, text
    assert "this rank is at (phase forward, layer 0, step 1) but rank 1 sent (phase forward, layer 1, step 1)" in text
    assert "this rank is at (phase forward, layer 1, step 1) but rank 0 sent (phase forward, layer 0, step 1)" in text


def test_dead_peer_fails_the_survivor_fast_naming_it(tmp_path):
    t0 = time.monotonic()
    result, text = run_case(tmp_path, "kill")
    assert result.codes == [3, 9], text
    assert "collective 'test step all-reduce' failed: rank(s) 1 exited" in text
    assert time.monotonic() - t0 < 20


def test_stuck_peer_times_out_within_the_configured_timeout(tmp_path):
    t0 = time.monotonic()
    result, text = run_case(tmp_path, "stuck", env={"CASE_TIMEOUT": "3"}, timeout=30)
    assert result.codes[0] == 3, text
    assert "collective 'test step all-reduce' failed: no peer answered within 3 s" in text
    assert time.monotonic() - t0 < 25


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_three_sft_steps_on_two_ranks_equal_one_process(tmp_path, kind, one_thread):
    """DP = 2 (dense) and EP = 2 (MoE): the global batch split over ranks gives one process's weights."""
    import dist_cases as cases
    from arbor.models import CausalLM
    from arbor.models.checkpoint import to_hf_tensors
    from arbor.train.optim import OptimConfig
    from arbor.train.sft import SFTConfig, sft
    result, text = run_case(tmp_path, "sft", kind)
    assert result.returncode == 0, text
    got = torch.load(tmp_path / "sft.pt")
    torch.manual_seed(0)
    model = CausalLM(cases.tiny_config(kind == "moe"))
    examples = [(s, [0] + [1] * (len(s) - 1)) for s in cases.sequences(5, 40)]
    cfg = SFTConfig(steps=3, batch_tokens=200, micro_tokens=48, log_every=1, checkpoint_every=0, tree=False,
                    moe_aux_coef=0.01 if kind == "moe" else 0.0, optim=OptimConfig(lr=1e-2, warmup_steps=0))
    history = sft(model, examples, cfg)
    want = to_hf_tensors(model)
    assert got["tensors"].keys() == want.keys()
    worst = max(float((got["tensors"][k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-5, worst
    assert [r["loss"] for r in got["history"]] == pytest.approx([r["loss"] for r in history], rel=1e-5)
    assert got["history"][-1]["grad_norm"] == pytest.approx(history[-1]["grad_norm"], rel=1e-5)
