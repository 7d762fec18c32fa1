"""``make gpu-check``'s script runs every check at toy sizes on the CPU (so it keeps working until a
GPU runs it), reports each, and refuses a missing CUDA device or an unknown check with exit 2."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multiprocess


def test_every_check_passes_at_toy_sizes_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "arbor.bench.gpu_check", "--device", "cpu", "--small", "--steps", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "gpu-check.json").read_text())
    assert set(r["results"]) == {"engine_greedy", "layer_kv", "server", "sft_bf16", "rl_bf16"}
    assert all(x["ok"] for x in r["results"].values()) and r["device"] == "cpu"
    assert r["results"]["rl_bf16"]["mismatch_abs"] > 0            # a bf16 trainer against a bf16 engine: not exact


def test_refuses_what_it_cannot_run(tmp_path):
    from arbor.bench.gpu_check import main
    assert main(["--device", "cpu", "--only", "nope", "--out", str(tmp_path)]) == 2
    if not torch.cuda.is_available():
        assert main(["--out", str(tmp_path)]) == 2
