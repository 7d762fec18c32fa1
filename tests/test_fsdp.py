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


def test_fsdp_is_refused_for_arbor_train_and_with_lora(tmp_path):
    from arbor import configs
    from arbor.train.config import RLConfig
    from arbor.train.run import train
    from arbor.train.sft import SFTRunConfig
    with pytest.raises(ValueError, match="`arbor train` serves the trainer's weights to its colocated rollout engine"):
        train(configs.load(RLConfig, None, [f"out={tmp_path}", "dist.fsdp=true"]))
    with pytest.raises(ValueError, match=r"with LoRA \(lora.rank > 0\) only the adapters train"):
        configs.load(SFTRunConfig, None, ["dist.fsdp=true", "lora.rank=4"])
