"""``engine.share_weights=false``: a float32 engine keeps its own (on CPU oneDNN-packed) copy of the
trainer's weights, so every sync must copy *and* repack it; the engine's log-probs then match the
trainer's at the weights just trained, up to the packed GEMM's summation order."""

import asyncio
import copy

import pytest
import torch

from arbor.bench.rl_setup import make_trainer
from arbor.engine import cpu_linear
from arbor.rollout.collector import RolloutConfig
from arbor.train.optim import OptimConfig
from arbor.engine.config import EngineConfig
from arbor.train.config import C3POConfig, RLConfig, RLRolloutConfig, engine_config
from arbor.train.rl import RLTrainer
from arbor.train.run import make_engine, rl_task

from tests.float64_ref import engine_gap
from tests.test_rl_loop import tiny  # noqa: F401  (the module-scoped tiny model fixture)


def config(**kw) -> RLConfig:
    base = dict(task="longtail", seed=0, groups_per_step=4, checkpoint_every=0, out="runs/test",
                rollout=RolloutConfig(max_turn_tokens=24, max_context=200, temperature=1.0, branch=[4]),
                optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0), c3po=C3POConfig(enabled=False))
    base.update(kw)
    return RLConfig(**base)


def gap(trainer, trajs) -> float:
    """Largest |engine log-prob − trainer log-prob at the trainer's current weights (in float64)| over
    model tokens."""
    return engine_gap(trainer.model, trajs)[0]


def assert_engine_matches(trainer, trajs) -> None:
    """The engine's log-probs are the trainer's at its current weights: within 10× the trainer's own
    float32 noise of the float64 value (tests/float64_ref.py; noise ≈ 5e-7 here)."""
    g, bound = engine_gap(trainer.model, trajs)
    assert g <= bound, f"engine log-probs off by {g:.3g} > {bound:.3g}"


def trajectories(trainer):
    trees, _, _ = asyncio.run(trainer.collect())
    return [t for tree in trees for t in tree.trajectories()]


def test_own_copy_is_refreshed_after_every_step(tiny, one_thread, monkeypatch):
    model, tok = tiny
    trainer = make_trainer(config(engine=EngineConfig(share_weights=False)), model, tok)
    served = trainer.engine.engine.model
    assert served is not trainer.model
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(served.parameters(), trainer.model.parameters()))
    if cpu_linear.available(torch.float32):
        assert trainer.engine.engine.num_packed > 0
    assert_engine_matches(trainer, trajectories(trainer))
    for _ in range(2):
        row = asyncio.run(trainer.train_step())
        assert row["optimizer_steps"] == 1
        assert_engine_matches(trainer, trajectories(trainer))     # the copy (and its packed GEMMs) moved too
    # the check has teeth: a sync that copies the parameters but leaves a packed copy stale is caught
    if trainer.engine.engine.num_packed:
        monkeypatch.setattr("arbor.engine.llm_engine.repack", lambda model: None)
        asyncio.run(trainer.train_step())
        assert gap(trainer, trajectories(trainer)) > 1e-3      # a stale copy is a step behind: measured 0.83


def test_own_copy_trains_like_the_shared_engine(tiny, one_thread):
    """Same seed, same sampled tokens (the copy rounds differently only in the last bits)."""
    model, tok = tiny
    rows = {}
    for share in (True, False):
        trainer = make_trainer(config(engine=EngineConfig(share_weights=share)), model, tok)
        first = trajectories(trainer)
        rows[share] = [t.tokens for t in first]
    assert rows[True] == rows[False]


def test_engine_share_weights_is_validated():
    from arbor import configs
    with pytest.raises(ValueError, match="'engine.share_weights' must be bool"):
        configs.load(RLConfig, None, ['engine.share_weights="no"'])
    with pytest.raises(ValueError, match="share_weights must be true or false"):
        config(engine=EngineConfig(share_weights="no"))


def test_overlap_with_an_own_copy_trains_the_given_model(tiny, one_thread):
    """``rollout.overlap`` needs the engine to serve weights the optimizer cannot reach mid-rollout;
    an engine with its own copy already does, so the trainer trains the model it was given (no
    second copy) and each sync still refreshes the engine's."""
    model, tok = tiny
    cfg = config(engine=EngineConfig(share_weights=False),
                 rollout=RLRolloutConfig(max_turn_tokens=24, max_context=200, temperature=1.0, branch=[4], overlap=True))
    given = copy.deepcopy(model)
    engine, sampling = make_engine(given, tok, engine_config(cfg))
    trainer = RLTrainer(cfg, given, tok, engine, sampling, rl_task(cfg, tok))
    rows = [asyncio.run(trainer.train_step()) for _ in range(3)]
    assert trainer.model is given and trainer.engine.engine.model is not given
    assert [r["staleness"] for r in rows] == [0, 1, 1]
    assert_engine_matches(trainer, trajectories(trainer))


def test_arbor_train_gives_a_small_cpu_model_an_own_copy_unless_told(monkeypatch):
    """``engine.share_weights`` unset: own copy on one CPU rank up to ``SHARE_ABOVE_PARAMS`` parameters, shared
    above it, on several ranks and on an accelerator; an explicit value wins."""
    from arbor.train import config as train_config
    from arbor.train.config import engine_shares
    cpu, cuda = config(), config(device="cuda")
    assert engine_shares(cpu, 10_000) is False and engine_shares(cpu, 2 * 10 ** 8) is True
    assert engine_shares(cuda, 10_000) is True and engine_shares(cpu, 10_000, ranks=2) is True
    assert engine_shares(config(engine=EngineConfig(share_weights=True)), 10_000) is True
    assert engine_shares(config(engine=EngineConfig(share_weights=False)), 2 * 10 ** 8) is False
    monkeypatch.setattr(train_config, "SHARE_ABOVE_PARAMS", 5)
    assert engine_shares(cpu, 10_000) is True


def test_build_trainer_follows_engine_shares(tmp_path):
    from arbor.train.run import build_trainer
    from tests.server_helpers import tiny_folder
    tiny_folder(tmp_path / "m")
    for value, owned in ((None, True), (True, False)):
        cfg = config(model=str(tmp_path / "m"), out=str(tmp_path / "out"), engine=EngineConfig(share_weights=value))
        trainer = build_trainer(cfg)
        assert (trainer.engine.engine.model is not trainer.model) == owned
