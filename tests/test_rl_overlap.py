"""``rollout.overlap=true``: the next step's rollout runs while this step trains (one-step off-policy).

What must hold: every trained token was sampled at θ_t-1 (staleness 1, versions per token), the
engine log-probs the loss gets as the behaviour policy are θ_t-1's (not θ_t's), the mismatch
correction sees that lag, the run learns, and a crash + resume equals the uninterrupted run."""

import asyncio
import copy
import json
import subprocess
import sys

import pytest
import torch

from arbor.bench.rl_setup import make_trainer
from arbor.rollout.collector import RolloutConfig
from arbor.train.optim import OptimConfig
from arbor.train.config import C3POConfig, RLConfig, RLRolloutConfig

from tests.float64_ref import engine_gap
from tests.test_rl_loop import tiny  # noqa: F401  (the module-scoped tiny model fixture)


def config(tmp_path=None, overlap=True, **kw) -> RLConfig:
    base = dict(task="longtail", seed=0, groups_per_step=4, checkpoint_every=0, out=str(tmp_path or "runs/test"),
                rollout=RLRolloutConfig(max_turn_tokens=24, max_context=200, temperature=1.0, branch=[4], overlap=overlap),
                optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0), c3po=C3POConfig(enabled=False))
    base.update(kw)
    return RLConfig(**base)


class Recording:
    """Wraps ``train_on`` to keep, per step, the trajectories trained and the weights they were trained from."""

    def __init__(self, trainer):
        self.steps = []
        inner = trainer.train_on

        def train_on(trajs, *a, **kw):
            self.steps.append((trajs, copy.deepcopy(trainer.model.state_dict())))
            return inner(trajs, *a, **kw)
        trainer.train_on = train_on


def test_overlapped_batches_come_from_the_previous_policy(tiny, one_thread):
    model, tok = tiny
    trainer = make_trainer(config(), model, tok)
    seen = Recording(trainer)
    rows = [asyncio.run(trainer.train_step()) for _ in range(4)]
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(r["rollout_ahead_s"] > 0 for r in rows)
    probe = copy.deepcopy(trainer.model)
    for step, (trajs, weights) in enumerate(seen.steps):
        versions = {v for t in trajs for v in t.versions if v >= 0}
        assert versions == {max(0, step - 1)}                   # versions per token: θ_t-1 (θ_0 at the first step)
        behaviour = seen.steps[max(0, step - 1)][1]             # the weights the engine sampled with
        for name, w in (("behaviour", behaviour), ("trained", weights)):
            probe.load_state_dict(w)
            gap, bound = engine_gap(probe, trajs)               # vs float64; bound: 10× float32 noise (≈ 5e-7)
            if name == "behaviour" or step == 0:
                assert gap <= bound, (step, name, gap, bound)   # the engine's log-probs are μ = π_θt-1 exactly
            else:
                assert gap > 1e-3, (step, gap)                  # … and not the trained θ_t's (measured ≥ 0.62)
    # the correction sees the lag: k = π_θt / μ is 1 (to float32 rounding) only at the first step
    assert rows[0]["mismatch_abs"] < 1e-5       # mean ≤ 2 × float32 noise (max 5e-7 here): 10×; measured 7.6e-8
    assert all(r["mismatch_abs"] > 1e-3 for r in rows[1:]), [r["mismatch_abs"] for r in rows]   # the lag: ≥ 0.19


def test_overlapped_rl_raises_reward(tiny, one_thread):
    model, tok = tiny
    trainer = make_trainer(config(), model, tok)
    rows = [asyncio.run(trainer.train_step()) for _ in range(12)]
    first, last = sum(r["reward"] for r in rows[:3]) / 3, sum(r["reward"] for r in rows[-3:]) / 3
    assert last > first + 0.1, (first, last)


def test_overlapped_run_resumes_bit_for_bit(tiny, tmp_path, one_thread):
    """The batch rolled out ahead is part of the checkpoint: crash + resume = the uninterrupted run."""
    model, tok = tiny
    keys = ("reward", "grad_norm", "samples", "staleness", "mismatch_abs", "entropy")

    def metrics(path):
        return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]

    kw = dict(steps=4, checkpoint_every=2, c3po=C3POConfig(enabled=True, token_budget=60, capacity=6))
    a = make_trainer(config(tmp_path / "a", **kw), model, tok)
    asyncio.run(a.run())
    asyncio.run(make_trainer(config(tmp_path / "b", **kw), model, tok).run(stop_after=3))
    b = make_trainer(config(tmp_path / "b", **kw), model, tok)
    asyncio.run(b.run())
    ra, rb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    assert all(r["staleness"] >= 1 for r in ra[1:])               # C3PO++ carry-overs may add versions
    for x, y in zip(ra, rb):
        for k in keys:
            assert x[k] == y[k], (k, x["step"])
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="overlap"):            # a checkpoint of the other schedule is refused
        asyncio.run(make_trainer(config(tmp_path / "b", overlap=False, **{**kw, "steps": 5}), model, tok).run())


def test_a_plain_rollout_config_means_no_overlap():
    cfg = RLConfig(rollout=RolloutConfig(max_turn_tokens=8))
    assert isinstance(cfg.rollout, RLRolloutConfig) and not cfg.rollout.overlap and cfg.rollout.max_turn_tokens == 8


@pytest.mark.parametrize("overrides,message", [
    (["rollout.overlap=true", "loss.correction=none"], "rollout.overlap=true needs loss.correction tis or icepop"),
    (["rollout.overlap_threads=-1"], "rollout.overlap_threads must be ≥ 0"),
    (["rollout.overlap=yes"], "'rollout.overlap' must be bool"),
])
def test_overlap_keys_are_validated(tmp_path, overrides, message):
    run = subprocess.run([sys.executable, "-m", "arbor.cli", "train", f"out={tmp_path / 'never'}", *overrides],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert not (tmp_path / "never").exists()


def test_bench_rl_times_both_schedules(tmp_path, one_thread):
    """``arbor bench rl --overlap both``: Arbor with and without overlap, the gain paired by round, a
    target per schedule; ``--threads 1`` runs the bench on one CPU (a thread budget is a core budget)
    and gives the process its CPUs back afterwards."""
    import os
    from arbor.bench.rl_workloads import default_model
    from arbor.cli import main
    before = os.sched_getaffinity(0)
    main(["bench", "rl", "--out", str(tmp_path), "--model", str(default_model(tmp_path / "model")), "--workload", "trl",
          "--steps", "1", "--prompts", "1", "--trl", "off", "--threads", "1", "--overlap", "both"])
    assert os.sched_getaffinity(0) == before
    result = json.loads((tmp_path / "rl.json").read_text())
    assert result["config"]["overlap"] == "both" and result["config"]["cpus"] == 1
    w = result["workloads"]["trl"]
    assert not w["arbor"]["overlap"] and w["arbor_overlap"]["overlap"]
    assert w["arbor_overlap"]["phases_s"]["rollout_ahead_s"] > 0 and w["overlap_speedup"] > 0
    assert w["arbor"]["tokens_per_step"] == w["arbor_overlap"]["tokens_per_step"] == 4 * 32
    assert [t["name"] for t in result["targets"]] == [
        "trl: Arbor ÷ TRL trained tokens/s, 1 threads (trl not installed: not measured)",
        "trl: Arbor (rollout.overlap=true) ÷ TRL trained tokens/s, 1 threads (trl not installed: not measured)"]
    with pytest.raises(SystemExit):
        main(["bench", "rl", "--out", str(tmp_path), "--trl", "off", "--overlap", "sometimes"])
