"""The RL objective family on real steps: PPO epochs / mini-batches, the reference KL, log-probs of
the sampling distribution, and validated configs."""

import asyncio
import copy
import subprocess
import sys

import pytest
import torch

from arbor.bench.rl_setup import make_trainer
from arbor.rollout.collector import RolloutConfig
from arbor.train.losses import LossConfig
from arbor.train.optim import OptimConfig
from tests.float64_ref import engine_gap
from tests.test_rl_loop import config


@pytest.fixture(scope="module")
def tiny():
    from arbor.models import CausalLM, ModelConfig
    from arbor.models.tokenizer import builtin_tokenizer
    from tests.test_rl_loop import SMALL
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id)).eval(), tok


def test_ppo_epochs_and_mini_batches_move_the_ratio_and_clip(tiny, one_thread):
    model, tok = tiny
    one = asyncio.run(make_trainer(config(optim=OptimConfig(lr=3e-3, warmup_steps=0, min_lr_ratio=1.0)),
                                   model, tok).train_step())
    assert one["optimizer_steps"] == 1 and one["approx_kl"] == 0.0 and one["clip_low"] + one["clip_high"] == 0.0
    cfg = config(ppo_epochs=2, mini_batches=4, optim=OptimConfig(lr=3e-3, warmup_steps=0, min_lr_ratio=1.0))
    row = asyncio.run(make_trainer(cfg, model, tok).train_step())
    assert row["optimizer_steps"] == 8
    assert row["approx_kl"] > 0                                   # r ≠ 1 after the first optimizer step
    assert row["clip_low"] + row["clip_high"] > 0                 # … far enough that the clip binds
    assert row["grad_norm_max"] >= row["grad_norm"] > 0 and row["entropy"] > 0


def test_reference_kl_keeps_the_starting_weights_frozen(tiny, one_thread):
    model, tok = tiny
    cfg = config(loss=LossConfig(kl_coef=0.5, kl_estimator="k3"), ppo_epochs=2,
                 optim=OptimConfig(lr=3e-3, warmup_steps=0, min_lr_ratio=1.0))
    trainer = make_trainer(cfg, model, tok)
    start = copy.deepcopy(trainer.model.state_dict())
    rows = [asyncio.run(trainer.train_step()) for _ in range(2)]
    for name, t in trainer.reference.state_dict().items():
        assert torch.equal(t, start[name]), name
    assert any(not torch.equal(t, start[n]) for n, t in trainer.model.state_dict().items())
    assert rows[0]["kl_ref"] >= 0 and rows[1]["kl_ref"] > 0      # the policy moved away from the reference
    assert make_trainer(config(), model, tok).reference is None   # kl_coef = 0 loads nothing


@pytest.mark.parametrize("tree", [True, False])
def test_engine_logprobs_equal_the_trainers_at_the_sampling_temperature(tiny, one_thread, tree):
    """T = 0.7, top-p 0.9: the engine's log-prob of each sampled token is the trainer's logp_old."""
    from arbor.train.tree_batch import TreeConfig
    model, tok = tiny
    cfg = config(task="arithmetic", tree=TreeConfig(enabled=tree),
                 rollout=RolloutConfig(max_turn_tokens=16, max_context=300, temperature=0.7, top_p=0.9, branch=[2, 2]))
    trainer = make_trainer(cfg, model, tok)
    trees, _, _ = asyncio.run(trainer.collect())
    trajs = [t for tree_ in trees for t in tree_.trajectories()]
    old, _, _ = trainer.recompute_old(trajs)
    gap, bound = engine_gap(trainer.model, trajs, lambda m: trainer.logprobs(trajs, model=m)[0])
    assert gap <= bound, (gap, bound)      # engine vs trainer in float64: 10× float32 noise (tests/float64_ref.py)
    checked = 0
    for t, lp in zip(trajs, old):         # recompute_old is that same float32 log-prob
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(lp[mask], torch.tensor(t.logp_infer)[mask], atol=1.1 * bound, rtol=0)  # gap + noise
        checked += int(mask.sum())
    assert checked > 50
    plain = make_trainer(config(task="arithmetic", tree=TreeConfig(enabled=tree)), model, tok)
    off = plain.logprobs(trajs[:1])[0]         # at T = 1 the same tokens have other log-probs
    assert not torch.allclose(off[torch.tensor(trajs[0].loss_mask, dtype=torch.bool)],   # ≫ float32 noise (5e-7)
                              old[0][torch.tensor(trajs[0].loss_mask, dtype=torch.bool)], atol=1e-3)


@pytest.mark.parametrize("override,message", [
    ("loss.correction=icepp", "loss.correction must be none, tis or icepop"),
    ("steps=-3", "steps must be ≥ 1"),
    ("steps=2.5", "'steps' must be int"),
    ("mini_batches=two", "'mini_batches' must be int"),
    ("tree=false", "'tree' is a config section"),
    ("rollout.branch=[2, 0]", "rollout.branch must be a non-empty list"),
    ("optim.lr=0", "optim.lr must be > 0"),
    ("loss.kl_estimator=k5", "loss.kl_estimator must be k1, k2 or k3"),
    ("engine.logit_noise_dist=laplace", "engine.logit_noise_dist must be one of"),
])
def test_invalid_overrides_exit_2_with_the_key_named_before_anything_runs(tmp_path, override, message):
    run = subprocess.run([sys.executable, "-m", "arbor.cli", "train", f"out={tmp_path / 'never'}", override],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert not (tmp_path / "never").exists()


def test_sft_takes_tree_and_recompute_keys():
    from arbor import configs
    from arbor.train.sft import SFTRunConfig
    cfg = configs.load(SFTRunConfig, None, ["train.tree.token_cap=1024", "train.tree.attention=dense",
                                            "train.recompute=true", "train.tree.replay=false"])
    assert cfg.train.tree.token_cap == 1024 and cfg.train.tree.attention == "dense"
    assert cfg.train.recompute is True and cfg.train.tree.replay is False
    with pytest.raises(ValueError, match="train.tree.attention must be segments or dense"):
        configs.load(SFTRunConfig, None, ["train.tree.attention=flash"])


def test_recompute_gives_the_same_step(tiny, one_thread):
    model, tok = tiny
    rows = [asyncio.run(make_trainer(config(recompute=on), model, tok).train_step()) for on in (False, True)]
    # float32 (the engine has no float64 path); recomputation reruns the same ops on the same CPU, so the two norms
    # differ at most by summation order (6e-8 relative per rounding, on any ISA): measured equal; rel 1e-6 ≈ 16 roundings
    assert rows[1]["grad_norm"] == pytest.approx(rows[0]["grad_norm"], rel=1e-6)
    assert rows[1]["reward"] == rows[0]["reward"]
