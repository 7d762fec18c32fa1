"""Multi-rank runtime: every rank runs in a child process (tests/dist_cases.py) under a hard timeout."""

import sys
import time
from pathlib import Path

import pytest
import torch

from arbor.distributed.launch import launch

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


@pytest.mark.parametrize("kind", ["dense", "moe", "moe-recompute"])
def test_three_sft_steps_on_two_ranks_equal_one_process(tmp_path, kind, one_thread):
    """DP = 2 (dense) and EP = 2 (MoE, also with recompute: each layer's exchanges run again in backward,
    the idle rank's too — 5 micro-batches on 2 ranks): the global batch split over ranks gives one
    process's weights (both in float64, so only the summation order differs)."""
    from tests import dist_cases as cases
    from arbor.models import CausalLM
    from arbor.models.checkpoint import to_hf_tensors
    from arbor.train.optim import OptimConfig
    from arbor.train.sft import SFTConfig, sft
    from arbor.train.tree_batch import TreeConfig
    result, text = run_case(tmp_path, "sft", kind, "float64")
    assert result.returncode == 0, text
    got = torch.load(tmp_path / "sft.pt")
    torch.manual_seed(0)
    model = CausalLM(cases.tiny_config(kind.startswith("moe"))).double()
    examples = [(s, [0] + [1] * (len(s) - 1)) for s in cases.sequences(5, 40)]
    cfg = SFTConfig(steps=3, batch_tokens=200, log_every=1, checkpoint_every=0, tree=TreeConfig(enabled=False, token_cap=48),
                    moe_aux_coef=0.01 if kind.startswith("moe") else 0.0, optim=OptimConfig(lr=1e-2, warmup_steps=0))
    history = sft(model, examples, cfg)
    want = to_hf_tensors(model)
    assert got["tensors"].keys() == want.keys()
    worst = max(float((got["tensors"][k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-10, worst       # float64, weights ~1: measured 2.4e-14 (moe), 2.7e-15 (dense); float32 read 1.1e-5
    assert [r["loss"] for r in got["history"]] == pytest.approx([r["loss"] for r in history], rel=1e-12)  # float64: 4e-16
    assert got["history"][-1]["grad_norm"] == pytest.approx(history[-1]["grad_norm"], rel=1e-12)        # float64: 6e-16


def test_launch_returns_the_failing_ranks_code_with_its_output(tmp_path):
    run = arbor_launch("eval", str(tmp_path / "missing"), timeout=60)
    assert run.returncode == 2
    assert "[rank 0] arbor eval: error: no config.json" in run.stdout
    assert "[rank 1] arbor eval: error: no config.json" in run.stdout
    assert "exited with code 2; stopped the other ranks" in run.stderr


def tiny_moe_folder(path):
    from arbor.models import CausalLM, ModelConfig, save_model
    from arbor.models.tokenizer import builtin_tokenizer
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, eos_token_id=tok.eos_token_id)
    model = CausalLM(cfg)
    save_model(model, path, tokenizer=tok)
    return model


def arbor_launch(*args, timeout=120):
    import subprocess
    return subprocess.run([sys.executable, "-m", "arbor.cli", "launch", "-n", "2", "--threads", "1",
                           "--timeout", str(timeout - 10), *args], capture_output=True, text=True, timeout=timeout)


def test_two_rank_rl_run_saves_one_hf_folder_and_resumes(tmp_path):
    import json

    import transformers
    tiny_moe_folder(tmp_path / "model")
    out = tmp_path / "out"
    common = [f"model={tmp_path / 'model'}", f"out={out}", "task=longtail", "groups_per_step=2", "checkpoint_every=1",
              "c3po.enabled=false", "rollout.max_turn_tokens=16", "rollout.max_context=120", "rollout.branch=[2]",
              "dist.timeout_s=30", "engine.policy=pd-multiplex", "dist.phase_groups=true"]   # P/D turnstile under EP
    run = arbor_launch("train", "steps=2", *common)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["samples"] == 8 for r in rows)   # 2 ranks × 2 groups × 2
    # EP engine and EP trainer compute the same log-probs: a float32 mean ≤ 2 × the log-prob noise (max ≈ 5e-7,
    # tests/float64_ref.py), so 1e-5 is 10×; measured 6.6e-8 to 8.9e-8
    assert all(r["mismatch_abs"] < 1e-5 for r in rows)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "final" / "model")
    assert hf.config.num_experts == 4
    run = arbor_launch("train", "steps=3", *common)        # resumes after step 2
    assert run.returncode == 0, run.stdout + run.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    from arbor import configs
    from arbor.train.config import RLConfig
    from arbor.train.run import train
    with pytest.raises(ValueError, match="written by 2 rank"):        # another world size is refused
        train(configs.load(RLConfig, None, ["steps=4", "log.progress=false", *common]))


def test_ep_load_reads_only_the_ranks_experts_and_save_gathers(tmp_path):
    from arbor.distributed import DistContext
    from arbor.models import load_model
    full = tiny_moe_folder(tmp_path / "model")
    ctx = DistContext(rank=1, world_size=2, ep_size=2)
    from arbor.models import checkpoint
    read = []
    original = checkpoint.read_tensors

    def spy(folder, device="cpu", keep=None):
        tensors = original(folder, device, keep)
        read.extend(tensors)
        return tensors
    checkpoint.read_tensors = spy
    try:
        part = load_model(tmp_path / "model", ctx=ctx)
    finally:
        checkpoint.read_tensors = original
    experts = {int(n.split(".")[5]) for n in read if ".mlp.experts." in n}
    assert experts == {2, 3}
    for layer, ref in zip(part.model.layers, full.model.layers):
        assert layer.mlp.experts.expert_ids == [2, 3]
        assert torch.equal(layer.mlp.experts.gate_up_proj, ref.mlp.experts.gate_up_proj[2:])
        assert torch.equal(layer.mlp.experts.down_proj, ref.mlp.experts.down_proj[2:])


def test_bad_layouts_say_what_to_change():
    from arbor.distributed import DistConfig, resolve_ep_size
    from arbor.models.expert_parallel import ExpertPlacement
    with pytest.raises(ValueError, match="does not divide the 6 experts"):
        resolve_ep_size(DistConfig(ep_size=4), 4, 6)
    with pytest.raises(ValueError, match="does not divide the world size 2"):
        resolve_ep_size(DistConfig(ep_size=4), 2, 8)
    with pytest.raises(ValueError, match="needs an MoE model"):
        resolve_ep_size(DistConfig(ep_size=2), 2, 0)
    assert resolve_ep_size(DistConfig(), 2, 8) == 2 and resolve_ep_size(DistConfig(), 2, 0) == 1
    with pytest.raises(ValueError, match="exactly 2 experts"):
        ExpertPlacement([0, 0, 0, 1], [0, 1, 2, 0], 2)
    assert ExpertPlacement([1, 0, 1, 0], [0, 0, 1, 1], 2).experts_of(0) == [1, 3]
