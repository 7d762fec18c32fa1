"""``arbor bench rl`` at its smallest settings, and the skipped θ_old pass it measures.

The bench test never needs ``trl``: it runs with ``--trl off`` (the TRL side is the same code path
with a subprocess added), and checks that the target entries then say null / not met.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import asyncio
import copy
import json

import pytest
import torch

from arbor.bench.rl import run_arbor
from arbor.bench.rl_workloads import default_model, text_of_tokens, workload
from arbor.cli import main
from arbor.models.tokenizer import builtin_tokenizer
from arbor.train.config import RLConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_model(tmp_path_factory.mktemp("rl_model"))


def test_bench_rl_writes_phases_and_targets(tmp_path, model_dir, one_thread):
    args = ["bench", "rl", "--out", str(tmp_path), "--model", str(model_dir), "--steps", "1", "--prompts", "1",
            "--trl", "off", "--threads", "1"]
    assert main(args) in (0, None)
    result = json.loads((tmp_path / "rl.json").read_text())
    assert set(result["workloads"]) == {"trl", "agentic"}
    for name, w in result["workloads"].items():
        a = w["arbor"]
        assert a["step_s"] > 0 and a["tokens_per_s"] > 0
        assert all(a["phases_s"][k] > 0 for k in ("rollout_s", "train_s", "sync_s")), a["phases_s"]
        assert a["recompute_skipped"] and "trl" not in w
        assert a["tokens_per_s"] == pytest.approx(a["tokens_per_step"] / a["step_s"], rel=1e-12)
        assert sum(a["phases_s"].values()) <= a["step_s"]          # the phases are parts of the (one) timed step
    # trained tokens: every trajectory's model tokens (agentic: 1 group × 8 trajectories × 3 turns × 64)
    assert result["workloads"]["trl"]["arbor"]["tokens_per_step"] == 4 * 32
    assert result["workloads"]["agentic"]["arbor"]["tokens_per_step"] == 8 * 3 * 64
    assert [t["value"] for t in result["targets"]] == [None, None]
    assert [t["met"] for t in result["targets"]] == [False, False]
    assert (tmp_path / "rl.png").exists()


def test_bench_rl_rejects_bad_flags(tmp_path):
    for bad in (["--steps", "0"], ["--rounds", "0"], ["--threads", "-1"], ["--model", str(tmp_path)], ["--workload", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "rl", "--out", str(tmp_path), "--trl", "off", *bad])
        assert e.value.code not in (0, None)


def test_agentic_workload_shape():
    tok = builtin_tokenizer()
    assert len(tok.encode(text_of_tokens(tok, 512, 0))) == 512
    w = workload("agentic")
    assert (w.samples, w.turns, w.new_tokens, w.system_tokens, w.prompts) == (8, 3, 64, 512, 2)


def test_skipped_recompute_trains_exactly_as_the_recompute(model_dir, one_thread):
    """One optimizer step per RL step: θ_old's log-probs from the training forward (detached) give
    the same update and metrics as a separate no-grad pass."""
    from arbor.bench.rl import arbor_trainer
    w = workload("trl", prompts=2, new_tokens=8)
    runs = {}
    for mode in ("auto", "recompute"):
        trainer = arbor_trainer(model_dir, w, 1, "float32", "cpu", old_logprobs=mode)
        assert trainer.skips_recompute == (mode == "auto")
        row = asyncio.run(trainer.train_step())
        runs[mode] = (row, copy.deepcopy(trainer.model.state_dict()))
    (a, wa), (b, wb) = runs["auto"], runs["recompute"]
    assert a["recompute_skipped"] == 1.0 and b["recompute_skipped"] == 0.0
    # logp.detach() of the training forward *is* the recompute's log-prob (the same float32 ops on the same
    # inputs): bit for bit, as ``RLTrainer.skips_recompute`` states (measured: AVX-512, AVX2, kernels off)
    for k in ("loss", "entropy", "mismatch_abs", "approx_kl", "tokens", "reward"):
        assert a[k] == b[k], k
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_old_logprobs_is_validated():
    with pytest.raises(ValueError, match="old_logprobs"):
        RLConfig(old_logprobs="never").validate()


def test_bench_rl_against_trl(tmp_path, model_dir, one_thread):
    """Only where trl is installed (not a dependency): the subprocess side runs and the ratio is recorded."""
    pytest.importorskip("trl")
    main(["bench", "rl", "--out", str(tmp_path), "--model", str(model_dir), "--workload", "trl", "--steps", "1",
          "--prompts", "1", "--trl", "on", "--threads", "1"])
    w = json.loads((tmp_path / "rl.json").read_text())["workloads"]["trl"]
    assert w["trl"]["step_s"] > 0 and w["ratio"] > 0
    assert w["trl"]["completion_tokens_per_step"] == 4 * 32
    [t] = json.loads((tmp_path / "rl.json").read_text())["targets"]
    assert t["value"] == pytest.approx(w["ratio"]) and t["met"] == (w["ratio"] >= 1.5)


def test_rounds_merge_to_medians():
    from arbor.bench.rl import PHASES, merge_rounds
    runs = [{"step_s": s, "tokens_per_s": 1 / s, "tokens_per_step": 1, "phases_s": {k: s for k in PHASES}} for s in (1, 3, 2)]
    m = merge_rounds(runs)
    assert m["step_s"] == 2 and m["tokens_per_s"] == 1 / 2 and m["phases_s"]["train_s"] == 2 and len(m["rounds"]) == 3


def test_bench_rl_engine_own_copy(tmp_path, model_dir, one_thread):
    """``--engine-share-weights false``: the float32 engine runs its own copy, synced every step."""
    main(["bench", "rl", "--out", str(tmp_path), "--model", str(model_dir), "--workload", "trl", "--steps", "1",
          "--prompts", "1", "--trl", "off", "--threads", "1", "--engine-share-weights", "false"])
    result = json.loads((tmp_path / "rl.json").read_text())
    assert result["config"]["engine_share_weights"] is False
    a = result["workloads"]["trl"]["arbor"]
    assert a["tokens_per_step"] == 4 * 32 and a["phases_s"]["sync_s"] > 0
