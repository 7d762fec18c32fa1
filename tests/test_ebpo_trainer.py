"""`arbor train` / `arbor eval` on a block-diffusion model: EBPO through the RL loop's config, run log
and checkpoints; a resumed run ends bit-identical to an uninterrupted one; config keys validated."""

import asyncio
import json

import pytest
import torch

from arbor import configs
from arbor.models import save_model
from arbor.models.tokenizer import builtin_tokenizer
from arbor.dllm.sft import DiffusionModelConfig, build_model
from arbor.train.config import RLConfig
from arbor.families import FAMILIES, evaluate as evaluate_folder, family

TINY = DiffusionModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, block_size=16)


@pytest.fixture(scope="module")
def dllm_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dllm")
    tok = builtin_tokenizer()
    save_model(build_model(tok, TINY, seed=0), out, tokenizer=tok)
    return out


def build_trainer(cfg):
    """What `arbor train` builds for ``cfg.model``: its family's trainer."""
    return family(cfg.model).build_trainer(cfg)


def cfg_for(model, out, estimator="ebpo", steps=3):
    return configs.load(RLConfig, None, [f"model='{model}'", f"out='{out}'", "task='sudoku'", f"steps={steps}",
                                         "groups_per_step=2", "dllm.group_size=3", "checkpoint_every=1",
                                         f"dllm.estimator='{estimator}'", "dllm.mode='threshold'", "log.progress=false",
                                         "log.tensorboard=false", "optim.lr=1e-2", "mini_batches=2"])


@pytest.mark.parametrize("estimator", ["ebpo", "espo", "mean_field"])
def test_train_resume_is_bit_identical(dllm_dir, tmp_path, estimator):
    full = build_trainer(cfg_for(dllm_dir, tmp_path / "a", estimator))
    assert type(full).__name__ == "EBPOTrainer"
    history = asyncio.run(full.run())
    assert [r["step"] for r in history] == [0, 1, 2]
    assert any(r["optimizer_steps"] > 0 for r in history)          # sudoku's partial credit gives signal
    assert all(0 <= r["reward"] <= 1 and r["tpf"] > 0 for r in history)
    stopped = build_trainer(cfg_for(dllm_dir, tmp_path / "b", estimator))
    asyncio.run(stopped.run(stop_after=2))
    resumed = build_trainer(cfg_for(dllm_dir, tmp_path / "b", estimator))
    asyncio.run(resumed.run())
    for (n, p), q in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), n
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["reward"] for r in rows] == [r["reward"] for r in history]


def test_config_keys_are_validated():
    with pytest.raises(ValueError, match="dllm.estimator.*'ebpo', 'ebpo_block', 'espo', 'mean_field'"):
        configs.load(RLConfig, None, ["dllm.estimator='wd1'"])
    with pytest.raises(ValueError, match="dllm.espo_mc"):
        configs.load(RLConfig, None, ["dllm.espo_mc=0"])
    assert configs.load(RLConfig, None, ["dllm.estimator='ebpo_block'"]).dllm.estimator == "ebpo_block"
    with pytest.raises(ValueError, match="dllm.levels"):
        configs.load(RLConfig, None, ["dllm.levels=[0.0, 0.5]"])
    with pytest.raises(ValueError, match="dllm.group_size"):
        configs.load(RLConfig, None, ["dllm.group_size=1"])


def test_eval_and_task_errors(dllm_dir, tmp_path):
    metrics = evaluate_folder(str(dllm_dir), "sudoku", 4)
    assert list(metrics) == ["test_accuracy"] and 0 <= metrics["test_accuracy"] <= 1
    from arbor.data.config import DataConfig
    from arbor.data.rewards import RewardConfig
    from arbor.tasks.registry import DIFFUSION_TASKS, load_task
    from arbor.dllm.sft import TASKS
    assert TASKS is DIFFUSION_TASKS                        # one registry for both kinds of task
    with pytest.raises(ValueError, match="block-diffusion task"):
        load_task(task="sudoku", data=DataConfig(), reward=RewardConfig(), tools=[], env="", seed=0, n_train=1, n_eval=1)
    with pytest.raises(ValueError, match="no diffusion version"):
        build_trainer(configs.load(RLConfig, None, [f"model='{dllm_dir}'", "task='arithmetic'"]))


def test_llm_engine_refuses_a_block_diffusion_model(dllm_dir):
    from arbor.engine import AsyncLLMEngine, LLMEngine
    from arbor.models import load_model
    for target in (dllm_dir, str(dllm_dir), load_model(dllm_dir)):
        with pytest.raises(ValueError, match="arbor generate --diffusion"):
            LLMEngine(target)
    with pytest.raises(ValueError, match="block-diffusion"):
        AsyncLLMEngine(dllm_dir)


def test_family_registry_routes_a_block_diffusion_folder(dllm_dir, tmp_path):
    """One registry decides: the folder's family, its trainer, and that Ray refuses it."""
    from arbor.cli import main
    assert family(dllm_dir) is FAMILIES["block_diffusion"] and not family(dllm_dir).on_ray
    assert main(["train", f"model={dllm_dir}", f"out={tmp_path / 'ray'}", "task=sudoku", "cluster=ray"]) == 2
    assert not (tmp_path / "ray").exists()
