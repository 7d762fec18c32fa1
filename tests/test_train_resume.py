"""Resumable training (``arbor.train.loop``): SFT, masked-diffusion SFT and TAD stopped between
checkpoints and started again end with the same weights and logs, bit for bit, as an uninterrupted
run; a checkpoint of other settings is refused; the CLI resumes from ``out/checkpoint``."""

import json

import pytest
import torch

from arbor.cli import main as cli_main
from arbor.models import CausalLM, ModelConfig, load_model
from arbor.models.tokenizer import builtin_tokenizer
from arbor.dllm.sft import DiffusionTrainConfig, build_model, task_examples, train_diffusion
from arbor.dllm.tad import TADConfig, cached_trajectories, distill, record_trajectories
from arbor.dllm.sft import Example
from arbor.train.optim import OptimConfig
from arbor.train.sft import SFTConfig, sft
from tests.test_diffusion_decode import tiny_model
from tests.test_diffusion_train import TINY
from tests.test_sft import SMALL, examples


def crash_then_resume(make_model, train, folder, crash_after: int, after_crash=None):
    """Train to the end in one go; then train in a fresh "process" that stops after ``crash_after``
    steps, and again in another one that resumes from its checkpoint → (uninterrupted, resumed)."""
    whole = make_model()
    h_whole = train(whole, None, None)
    crashed = make_model()
    train(crashed, lambda step: step + 1 == crash_after, folder)
    if after_crash:
        after_crash()
    resumed, seen = make_model(), []
    h_resumed = train(resumed, lambda step: seen.append(step) and False, folder)
    every = 2                                           # every test checkpoints each 2 steps
    assert seen[0] == crash_after // every * every      # it did resume: from the last checkpoint
    assert h_resumed == h_whole
    return whole, resumed


def assert_same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_sft_resumes_bit_for_bit(tmp_path):
    tok, ex = examples(32)

    def make():
        torch.manual_seed(0)
        return CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id))

    cfg = SFTConfig(steps=7, batch_tokens=600, log_every=2, checkpoint_every=2,
                    optim=OptimConfig(lr=2e-3, warmup_steps=2))
    whole, resumed = crash_then_resume(make, lambda m, until, folder: sft(m, ex, cfg, until=until, checkpoint_dir=folder),
                                       tmp_path / "ckpt", crash_after=5)      # checkpoint at 4, step 5 lost
    assert_same_weights(whole, resumed)
    # a checkpoint written with other settings is refused, naming the setting, and nothing is loaded
    fresh, untouched = make(), make()
    with pytest.raises(ValueError, match=r"optim.*delete"):
        sft(fresh, ex, SFTConfig(steps=7, batch_tokens=600, checkpoint_every=2, optim=OptimConfig(lr=1e-3)),
            checkpoint_dir=tmp_path / "ckpt")
    assert_same_weights(fresh, untouched)
    # so is one without the state this version resumes from
    state = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)
    del state["settings"]
    torch.save(state, tmp_path / "ckpt" / "trainer.pt")
    with pytest.raises(ValueError, match="lacks settings"):
        sft(make(), ex, cfg, checkpoint_dir=tmp_path / "ckpt")


def test_diffusion_training_resumes_bit_for_bit(tmp_path):
    tok = builtin_tokenizer()
    _, data = task_examples(tok, "addition", 32, 0, "train", TINY.block_size)
    cfg = DiffusionTrainConfig(steps=6, batch_size=8, log_every=1, checkpoint_every=2, model=TINY)

    def make():
        return build_model(tok, TINY, seed=0)

    whole, resumed = crash_then_resume(make, lambda m, until, folder: train_diffusion(m, data, cfg, until=until,
                                                                                    checkpoint_dir=folder),
                                       tmp_path / "ckpt", crash_after=3,
                                       after_crash=lambda: (tmp_path / "ckpt").rename(tmp_path / "ckpt.tmp"))
    assert_same_weights(whole, resumed)      # found in ckpt.tmp: the crash came between save_state's moves


def test_tad_resumes_bit_for_bit(tmp_path):
    teacher = tiny_model(block_size=4, seed=12, scale=0.3)
    data = [Example([5 + i, 6, 7], [0] * 6, [9, 9, 9, 9, 5 + i, 6, 7]) for i in range(4)]
    trajs = record_trajectories(teacher, data, lambda i, toks: True, gen_length=6)
    cfg = TADConfig(delta=3, steps=5, batch_size=8, log_every=1, checkpoint_every=2, visible_weight=1.0)
    whole, resumed = crash_then_resume(lambda: tiny_model(block_size=4, seed=13, scale=0.3),
                                       lambda m, until, folder: distill(m, trajs, cfg, teacher, until=until,
                                                                        checkpoint_dir=folder),
                                       tmp_path / "ckpt", crash_after=3)
    assert_same_weights(whole, resumed)


def test_teacher_trajectories_are_recorded_once_per_source(tmp_path):
    teacher = tiny_model(block_size=4, seed=12, scale=0.3)
    data = [Example([5 + i, 6, 7], [0] * 6, [9, 9, 9, 9, 5 + i, 6, 7]) for i in range(3)]
    calls = []

    def record(n):
        calls.append(n)
        return record_trajectories(teacher, data[:n], lambda i, toks: True, gen_length=6)

    path = tmp_path / "tad" / "trajectories.pt"
    first = cached_trajectories(path, {"per_task": 3}, lambda: record(3))
    again = cached_trajectories(path, {"per_task": 3}, lambda: record(3))          # a resumed run: loaded
    other = cached_trajectories(path, {"per_task": 2}, lambda: record(2))          # another source: recorded
    assert calls == [3, 2] and len(other) == 2
    assert [[s.tolist() for s in t.states] for t in again] == [[s.tolist() for s in t.states] for t in first]


def test_cli_sft_resumes_from_its_checkpoint(tmp_path, capsys):
    out = tmp_path / "sft"
    words = [f"out={out}", "demos=16", "train.batch_tokens=300", "train.log_every=1", "train.checkpoint_every=2"]
    assert cli_main(["sft", *words, "train.steps=2"]) == 0
    assert (out / "checkpoint" / "trainer.pt").exists()
    capsys.readouterr()
    assert cli_main(["sft", *words, "train.steps=3"]) == 0          # more steps: continues from step 2
    assert "sft: resumed from step 2" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]                     # one row per step, none twice
    assert load_model(out).config.num_hidden_layers > 0
    # other data into the same folder: refused (the run's settings, not only the optimizer's, must match)
    assert cli_main(["sft", *words, "train.steps=3", "demos=20"]) == 2
    assert "demos: 16 → 20" in capsys.readouterr().err


def test_a_nonfinite_step_stops_the_run_before_it_is_saved(tmp_path, capsys):
    """A NaN learning signal: the run stops naming the step, the last good checkpoint stays as it was;
    with optim.skip_nonfinite the step is skipped and counted instead."""
    out = tmp_path / "sft"
    words = [f"out={out}", "demos=16", "train.batch_tokens=300", "train.log_every=1", "train.checkpoint_every=1",
             "train.steps=4", "train.optim.lr=1e30", "train.optim.warmup_steps=0"]     # step 0 blows the weights up
    assert cli_main(["sft", *words]) == 2
    err = capsys.readouterr().err
    assert "step 1: the gradient norm is" in err and "not finite" in err
    state = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["step"] == 1                               # the last good checkpoint: after step 0, kept
    assert not (out / "model.safetensors").exists()         # no final model


def test_nonfinite_gradients_are_skipped_when_asked():
    from arbor.train.optim import NonFiniteError, make_optimizer, optimizer_step
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    model(torch.full((1, 3), float("nan"))).sum().backward()
    with pytest.raises(NonFiniteError, match="step 7"):
        optimizer_step(model, make_optimizer(model, OptimConfig()), 7, 10, OptimConfig())
    model(torch.full((1, 3), float("nan"))).sum().backward()
    stats = optimizer_step(model, make_optimizer(model, OptimConfig()), 7, 10, OptimConfig(skip_nonfinite=True))
    assert stats["skipped"] == 1.0 and torch.equal(model.weight, before) and model.weight.grad is None


@pytest.mark.parametrize("damage", ["nan tensor", "flipped byte", "truncated trainer.pt"])
def test_a_damaged_checkpoint_is_refused_naming_what(tmp_path, capsys, damage):
    from safetensors.torch import load_file, save_file
    out = tmp_path / "sft"
    words = [f"out={out}", "demos=16", "train.batch_tokens=300", "train.log_every=1", "train.checkpoint_every=2"]
    assert cli_main(["sft", *words, "train.steps=2"]) == 0
    ckpt = out / "checkpoint"
    weights = ckpt / "model" / "model.safetensors"
    if damage == "nan tensor":          # a NaN written consistently (its checksum re-recorded): still refused
        import hashlib
        tensors = load_file(str(weights))
        name = sorted(tensors)[0]
        tensors[name][0].fill_(float("nan"))
        save_file(tensors, str(weights), metadata={"format": "pt"})
        state = torch.load(ckpt / "trainer.pt", weights_only=False)
        state["checksums"]["model/model.safetensors"] = hashlib.sha256(weights.read_bytes()).hexdigest()
        torch.save(state, ckpt / "trainer.pt")
        want = f"tensor '{name}' holds NaN or inf values"
    elif damage == "flipped byte":
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
        want = "model.safetensors is corrupted or truncated"
    else:
        (ckpt / "trainer.pt").write_bytes((ckpt / "trainer.pt").read_bytes()[:100])
        want = "trainer.pt"
    capsys.readouterr()
    assert cli_main(["sft", *words, "train.steps=3"]) == 2
    assert want in capsys.readouterr().err


def test_model_folder_errors_name_the_file(tmp_path):
    from arbor.models import ConfigError
    from arbor.models.tokenizer import Tokenizer
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=str(tmp_path / "config.json")):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path}"):
        Tokenizer.load(tmp_path)


def test_checkpoint_from_before_a_config_key_resumes_with_the_value_it_had(tmp_path):
    """A run saved before ``loss.agg`` existed had per-sample aggregation: it resumes with
    ``loss.agg=sequence``, and the new default is refused with the change named."""
    from arbor.train.checkpoint import settings_of, _check_same_settings
    from arbor.train.config import RLConfig
    from arbor.train.losses import LossConfig
    old = settings_of(RLConfig(loss=LossConfig(agg="sequence")))
    del old["loss"]["agg"]
    _check_same_settings(tmp_path, old, settings_of(RLConfig(loss=LossConfig(agg="sequence"))))
    with pytest.raises(ValueError, match=r"loss: .*'agg': 'sequence'.*'agg': 'token'"):
        _check_same_settings(tmp_path, old, settings_of(RLConfig()))
