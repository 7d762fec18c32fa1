"""The promise as users meet it: `arbor train` in subprocesses, at the default thread count.

Two runs of one seed end with the same weights, bit for bit, and so does a run killed with
SIGKILL (once while it writes a checkpoint, once at a random moment) and started again with the
same command, which resumes from ``out/checkpoint``. The model is a tiny random MoE (the routed
experts' gather is one of the paths whose backward must add repeated rows in a fixed order) on
the long-tail task, where a random model earns rewards, so every step moves the weights.
"""

import json
import random
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from tests.test_dist import tiny_moe_folder

pytestmark = pytest.mark.slow
STEPS = 3
TIMEOUT_S = 120


def command(model, out):
    return [sys.executable, "-m", "arbor.cli", "train", f"model={model}", f"out={out}", "task=longtail",
            f"steps={STEPS}", "checkpoint_every=1", "groups_per_step=2", "rollout.max_turn_tokens=16",
            "rollout.max_context=120", "c3po.token_budget=200", "log.progress=false", "log.tensorboard=false"]


def run(model, out) -> float:
    """Run to the end; → its wall-clock seconds."""
    t0 = time.monotonic()
    done = subprocess.run(command(model, out), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic() - t0


def killed(model, out, when) -> bool:
    """Start the run and SIGKILL it when ``when(out)`` holds (polled every millisecond);
    → True if it was killed, False if it finished first."""
    p = subprocess.Popen(command(model, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        while p.poll() is None:
            if when(out):
                p.send_signal(signal.SIGKILL)
                p.wait()
                return True
            assert time.monotonic() - t0 < TIMEOUT_S, "the run neither finished nor was killed in time"
            time.sleep(0.001)
        assert p.returncode == 0
        return False
    finally:
        if p.poll() is None:
            p.kill()


def weights(out):
    return load_file(out / "final" / "model" / "model.safetensors")


def steps_logged(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_same_seed_and_killed_runs_end_with_identical_weights(tmp_path):
    model = tmp_path / "model"
    tiny_moe_folder(model)
    start = load_file(model / "model.safetensors")
    seconds = run(model, tmp_path / "a")
    run(model, tmp_path / "b")
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert any(not a[k].equal(start[k]) for k in a)               # RL moved the weights
    assert all(a[k].equal(b[k]) for k in a), "two runs of one seed differ"

    out = tmp_path / "killed"
    during_write = lambda o: (o / "checkpoint.tmp").exists()
    assert killed(model, out, during_write)
    assert (out / "checkpoint.tmp").exists()                       # it died inside a checkpoint write
    deadline = time.monotonic() + random.Random(0).uniform(0.3, 0.9) * seconds
    killed(model, out, lambda o: time.monotonic() > deadline)      # may finish first: then nothing to resume
    run(model, out)
    c = weights(out)
    assert all(a[k].equal(c[k]) for k in a), "a killed and resumed run differs from the uninterrupted one"
    assert steps_logged(out) == list(range(STEPS))
