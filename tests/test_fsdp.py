"""Sharded data parallelism (``dist.fsdp=true``, FSDP2): ranks run in child processes
(tests/fsdp_cases.py) under a hard timeout; the one-process references run here, without collectives."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arbor.distributed.launch import launch

CASES = str(Path(__file__).with_name("fsdp_cases.py"))
KINDS = ["dense", "moe", "moe-dp"]      # moe: experts over 2 EP ranks, kept whole; moe-dp: experts sharded by FSDP


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each kind's 2-rank run (launched once, on first use): → (out folder, what rank 0 saved)."""
    done = {}

    def get(kind):
        if kind not in done:
            out = tmp_path_factory.mktemp(kind)
            result = launch([sys.executable, CASES, "sft", str(out), kind], 2, threads=1, timeout_s=60, echo=None,
                            grace_s=5)
            text = "\n".join(f"[rank {r}] {line}" for r in range(2) for line in result.output[r])
            assert result.returncode == 0, text
            done[kind] = out, torch.load(out / "sft.pt", weights_only=False)
        return done[kind]
    return get


@functools.cache
def one_process(kind):
    """The same three steps in this process: → (HF tensors, history, optimizer state bytes)."""
    from tests.fsdp_cases import reference
    return reference(kind)


@pytest.mark.multiprocess
@pytest.mark.numerics
@pytest.mark.parametrize("kind", KINDS)
def test_three_fsdp_sft_steps_on_two_ranks_equal_one_process(runs, kind, one_thread):
    """float64, so only the summation order differs; gradients clipped every step (grad_clip 0.5 < ‖g‖),
    and one rank runs an idle pass every step (5 micro-batches on 2 ranks)."""
    _, got = runs(kind)
    want, history, _ = one_process(kind)
    assert got["tensors"].keys() == want.keys()
    worst = max(float((got["tensors"][k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-12, worst        # measured 2.5e-16 (dense), 9.2e-15 (moe), 4.6e-15 (moe-dp)
    assert [r["loss"] for r in got["history"]] == pytest.approx([r["loss"] for r in history], rel=1e-12)
    assert [r["grad_norm"] for r in got["history"]] == pytest.approx([r["grad_norm"] for r in history], rel=1e-12)
    assert all(r["grad_norm"] > 0.5 for r in history)       # the clip is active


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_each_rank_holds_half_the_optimizer_state(runs, kind, one_thread):
    """Bytes of ``optimizer.state`` (AdamW moments, local shards): each rank ≈ 1/2 of one process's; only the
    per-parameter step counters are whole on every rank. Measured (dense) 396,388 B vs 198,244 B per rank."""
    _, got = runs(kind)
    _, _, total = one_process(kind)
    per_rank = got["state_bytes"]
    assert len(per_rank) == 2 and all(b <= 0.51 * total for b in per_rank), (per_rank, total)
    assert sum(per_rank) == pytest.approx(total, rel=0.01), (per_rank, total)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_checkpoint_holds_full_weights_and_rank_shards_and_resumes(runs, kind):
    """Stopped after step 1 and resumed from its checkpoint (fresh model and optimizer), the run ends bit for
    bit where the uninterrupted one does; the checkpoint's model is one whole HF folder and each rank file
    holds that rank's half of every moment."""
    from arbor.models import load_model
    out, got = runs(kind)
    assert [r["step"] for r in got["resumed_history"]] == [0, 1, 2]
    assert [r["loss"] for r in got["resumed_history"]] == [r["loss"] for r in got["history"]]
    assert all(torch.equal(got["resumed"][k], got["tensors"][k]) for k in got["tensors"])
    model = load_model(out / "checkpoint" / "model")
    assert model.model.embed_tokens.weight.shape == (96, 32)
    for r in (0, 1):
        moments = torch.load(out / "checkpoint" / f"rank{r}.pt", weights_only=False)["optimizer"]["state"]
        shapes = {tuple(s["exp_avg"].shape) for s in moments.values()}
        assert (48, 32) in shapes and (96, 32) not in shapes, shapes      # embed_tokens: rows 48·r … 48·r + 47


@pytest.mark.multiprocess
def test_fsdp_on_one_rank_exits_2_naming_the_fix(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    run = subprocess.run([sys.executable, "-m", "arbor.cli", "sft", "model=tiny", f"out={tmp_path}", "dist.fsdp=true",
                          "log.progress=false"], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "dist.fsdp=true shards parameters over ranks and needs ≥ 2 ranks (arbor launch -n N …)" in run.stderr


def test_fsdp_is_refused_with_lora(tmp_path):
    from arbor import configs
    from arbor.train.config import RLConfig
    from arbor.train.sft import SFTRunConfig
    for cls in (RLConfig, SFTRunConfig):
        with pytest.raises(ValueError, match=r"with LoRA \(lora.rank > 0\) only the adapters train"):
            configs.load(cls, None, ["dist.fsdp=true", "lora.rank=4"])


@pytest.mark.multiprocess
def test_two_rank_fsdp_rl_run_saves_one_hf_folder_and_resumes(tmp_path):
    """`arbor launch -n 2 train … dist.fsdp=true`: rollouts on each rank's own engine (whole weights synced
    from the shards every step), one HF folder at the end, a checkpoint every step that resumes."""
    import json

    from tests.server_helpers import tiny_folder
    out = tmp_path / "out"
    common = [f"model={tiny_folder(tmp_path / 'model')}", f"out={out}", "task=longtail", "groups_per_step=2", "checkpoint_every=1", "dist.fsdp=true",
              "c3po.enabled=false", "rollout.max_turn_tokens=8", "dist.timeout_s=30", "eval_every=0"]
    launch_ = lambda *a: subprocess.run([sys.executable, "-m", "arbor.cli", "launch", "-n", "2", "--threads", "1",
                                         "--timeout", "110", "train", *a, *common], capture_output=True, text=True,
                                        timeout=120)
    run = launch_("steps=2")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["samples"] > 0 and r["grad_norm"] > 0 for r in rows)
    # the engine's float32 copy is the trainer's gathered weights: log-probs agree to float32 noise (≤ 5e-7,
    # tests/float64_ref.py; 1e-5 is 20×); a stale or sharded copy would be off by the step's update
    assert all(r["mismatch_abs"] < 1e-5 for r in rows[1:]), [r["mismatch_abs"] for r in rows]
    assert (out / "final" / "model" / "config.json").exists()
    run = launch_("steps=3")                    # resumes after step 2
    assert run.returncode == 0, run.stdout + run.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


@pytest.mark.multiprocess
@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["dense", "moe-dp"])
def test_fsdp_rl_update_on_two_ranks_equals_one_process_and_syncs_whole_weights(tmp_path, kind, one_thread):
    """``arbor train``'s update (θ_old recomputed under no_grad, a KL reference, two optimizer steps, the clip
    active, idle passes on the rank with fewer micro-batches) in float64: only the summation order differs.
    The engine's copy after the sync is the gathered weights, cast to its float32."""
    from tests.fsdp_cases import rl_reference
    result = launch([sys.executable, CASES, "rl", str(tmp_path), kind], 2, threads=1, timeout_s=90, echo=None, grace_s=5)
    assert result.returncode == 0, "\n".join(f"[rank {r}] {line}" for r in range(2) for line in result.output[r])
    got = torch.load(tmp_path / "rl.pt", weights_only=False)
    want, rows = rl_reference(kind)
    worst = max(float((got["tensors"][k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-12, worst        # measured 7.9e-16 (dense), 1.9e-15 (moe-dp)
    for key in ("loss", "grad_norm", "kl_ref", "approx_kl"):
        assert [r[key] for r in got["rows"]] == pytest.approx([r[key] for r in rows], rel=1e-10), key
    assert all(r["grad_norm"] > 0.2 for r in rows) and rows[-1]["approx_kl"] > 0     # the clip acts; θ moved off θ_old
    assert got["served"].keys() == got["whole"].keys()
    assert all(torch.equal(got["served"][k], v.float()) for k, v in got["whole"].items())
