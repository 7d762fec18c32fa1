"""The memory plan (``arbor.train.memory_plan``): what each knob changes, the CLI table, and a job that
cannot fit stops before step one with exit 2, naming its largest items and their knobs."""

import json

from arbor.cli import main
from arbor.models.lora import DEFAULT_TARGETS
from arbor.models.presets import preset_config
from arbor.models.tokenizer import builtin_tokenizer
from arbor.train.memory_plan import PlanInputs, parameter_counts, peak_bytes, plan


def items(**kw) -> dict[str, int]:
    base = dict(model=preset_config("tiny", builtin_tokenizer()), dtype="float32", lora_rank=0,
                lora_targets=DEFAULT_TARGETS, tokens=512, recompute=False, device="cpu")
    return {name.split(" (")[0]: b for name, b, _ in plan(PlanInputs(**(base | kw)))}


def test_each_knob_shrinks_its_items():
    full, lora = items(), items(lora_rank=4, dtype="bfloat16")
    counts = parameter_counts(preset_config("tiny", builtin_tokenizer()), 4, DEFAULT_TARGETS)
    whole = parameter_counts(preset_config("tiny", builtin_tokenizer()), 0, DEFAULT_TARGETS)["total"]
    assert full["optimizer state"] == 8 * whole and lora["optimizer state"] == 8 * counts["trained"]
    assert lora["gradients"] == 4 * counts["trained"] < full["gradients"] / 10
    assert lora["weights"] == 2 * whole + 4 * counts["trained"] and full["weights"] == 4 * whole   # the frozen base in bf16
    assert items(world_size=2, fsdp=True)["optimizer state"] == full["optimizer state"] // 2
    assert items(recompute=True)["activations"] < full["activations"] / 2
    assert abs(items(tokens=1024)["activations"] - 2 * full["activations"]) <= 2     # linear in tokens
    assert "autocast weight copies" in items(dtype="bfloat16") and "autocast weight copies" not in full
    planned = plan(PlanInputs(model=preset_config("tiny", builtin_tokenizer()), dtype="float32", lora_rank=0,
                              lora_targets=DEFAULT_TARGETS, tokens=512, recompute=False, device="cpu"))
    size = {name.split(" (")[0]: b for name, b, _ in planned}
    rest = sum(b for k, b in size.items() if k not in ("activations", "log-prob head", "head gradient", "gradients"))
    assert peak_bytes(planned) == rest + max(size["activations"] + size["log-prob head"] + size["head gradient"],
                                             size["gradients"])


def test_plan_memory_prints_the_table(capsys):
    import os
    env = dict(os.environ)
    assert main(["plan", "memory", "tiny", "lora.rank=4", "dtype=bfloat16", "rollout.max_context=256", "--ranks", "2"]) == 0
    assert dict(os.environ) == env                      # the rank count is the plan's, not the process's
    out = capsys.readouterr().out
    assert "2 rank(s)" in out and "× 2 ranks on this host" in out
    for row in ("weights", "optimizer state", "activations", "log-prob head", "engine KV cache", "peak", "free on cpu"):
        assert row in out, row
    assert "LoRA rank 4" in out and "fits" in out


def test_a_job_that_cannot_fit_stops_before_step_one(tmp_path, capsys):
    """A 2.6 B-parameter model (a 20 M-word vocabulary on hidden 128): its float32 AdamW state alone is
    ~31 GiB and its log-prob head terabytes, more than any test machine has. Only config.json exists:
    the plan runs before any weights or data are read."""
    cfg = preset_config("tiny", builtin_tokenizer()).to_hf() | {"vocab_size": 20_000_000, "architectures": ["Qwen3ForCausalLM"]}
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(cfg))
    assert main(["sft", f"model={tmp_path / 'big'}", f"out={tmp_path / 'out'}", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "stops before step one" in err and "optimizer state" in err and "lora.rank" in err and "memory_check=false" in err
    assert not (tmp_path / "out").exists()


def test_allocator_slack_is_the_activations_the_gradients_do_not_refill():
    full, lora = items(), items(lora_rank=4, dtype="bfloat16")
    assert full["allocator slack"] == max(0, full["activations"] - full["gradients"])
    assert lora["allocator slack"] == lora["activations"] - lora["gradients"] > 0


SWITCH = """
import sys
from arbor.kernels.allocator import allocator_mode
from arbor.models.presets import preset_config
from arbor.models.tokenizer import builtin_tokenizer
from arbor.train import memory_plan as mp
inp = mp.PlanInputs(model=preset_config("tiny", builtin_tokenizer()), dtype="bfloat16", lora_rank=4,
                    lora_targets=["q_proj"], tokens=4096, recompute=False, device="cpu")
mp.plan(inp)                            # warm: the first plan's imports and probe grow the process
items = mp.plan(inp)
lean = [it for it in items if not it[0].startswith("allocator slack")]
mp.available_bytes = lambda device: (mp.peak_bytes(items) + mp.peak_bytes(lean)) // 2   # fits only as lean
try:
    mp.check(inp, "job")
    print("ran", allocator_mode())
except mp.MemoryPlanError as e:
    print("stopped", allocator_mode(), e)
"""


def test_a_job_that_fits_only_without_the_heaps_slack_switches_to_the_lean_allocator():
    """Each case in a fresh process: the switch is process-wide. Set by the user, ARBOR_MALLOC wins."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "ARBOR_MALLOC"}
    out = subprocess.run([sys.executable, "-c", SWITCH], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "ran lean" and "ARBOR_MALLOC=lean" in out.stdout
    out = subprocess.run([sys.executable, "-c", SWITCH], env=env | {"ARBOR_MALLOC": "tuned"}, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1].startswith("stopped tuned"), out.stdout + out.stderr


def test_an_own_cpu_engine_copy_counts_its_packed_copies():
    """Own copy on CPU: weights plus the packed copies (every linear twice with the few-row kernel, once
    without); a shared engine counts neither."""
    from arbor.engine.config import EngineConfig
    counts = parameter_counts(preset_config("tiny", builtin_tokenizer()), 0, DEFAULT_TARGETS)
    own = items(engine=EngineConfig(), engine_shares=False)
    assert own["engine weights"] == counts["total"] * 4
    assert own["engine's packed copies"] == counts["linear"] * 2 * 4
    assert items(engine=EngineConfig(few_row_kernel=False), engine_shares=False)["engine's packed copies"] == \
        counts["linear"] * 4
    shared = items(engine=EngineConfig(), engine_shares=True)
    assert "engine weights" not in shared and "engine's packed copies" not in shared
    assert "engine's packed copies" not in items(engine=EngineConfig(fp32_gemm="exact"), engine_shares=False)
