"""The user's path end to end, in subprocesses: files in a folder → ``arbor sft`` → ``arbor eval`` →
``arbor train``, and RL raises the held-out reward over its SFT start.

The files are what a user writes: JSONL rows (``prompt`` + ``answer``) and SFT conversations, a
tools file (a typed function with a Google docstring) and a rewards file with a TRL-form function
(``correct``) and an Arbor-form one (``is_color``: a format reward). The task is one a tiny model
learns in seconds: "What color is Ann's plum?". The demonstrations call the ``color`` tool on a
quarter of the rows and guess a color on the rest, so the SFT model mostly guesses (right 1 time in
6); RL rewards the right answers and the policy learns to call the tool, or the colors themselves.
"""

import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
TIMEOUT_S = 120
COLORS = {"banana": "yellow", "lime": "green", "plum": "purple", "cherry": "red", "orange": "orange",
          "blueberry": "blue"}
ROOT = Path(__file__).resolve().parents[1]
TOOLS = f'''
COLORS = {COLORS!r}


def color(fruit: str) -> str:
    """The color of a fruit.

    Args:
        fruit: the fruit's name, e.g. plum
    """
    return COLORS.get(fruit.strip().lower(), "unknown fruit")
'''
REWARDS = f'''
def correct(prompts, completions, answer, **kwargs):      # TRL form: a batch in, a list out
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def is_color(prompt, completion, **row):                  # Arbor form: one sample
    return float(completion.strip() in {sorted(set(COLORS.values()))})
'''


def write_user_files(folder):
    """The user's files (module docstring; the rows are examples/openai-agent's, from the same
    fruit colors) → their paths."""
    make_data = runpy.run_path(str(ROOT / "examples" / "openai-agent" / "make_data.py"))   # the example's rows
    make_data["main"](folder)
    paths = {name: folder / name for name in ("train.jsonl", "test.jsonl", "sft.jsonl")}
    for name, text in (("tools.py", TOOLS), ("rewards.py", REWARDS)):
        paths[name] = folder / name
        paths[name].write_text(text)
    return paths


def arbor(*words) -> str:
    done = subprocess.run([sys.executable, "-m", "arbor", *map(str, words)], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_sft_then_rl_from_user_files_raises_held_out_reward(tmp_path):
    f = write_user_files(tmp_path)
    tools = f'tools=["{f["tools.py"]}:color"]'
    rows = [f"data.train={f['train.jsonl']}", f"data.eval={f['test.jsonl']}", tools,
            f'reward.fns=["{f["rewards.py"]}:correct", "{f["rewards.py"]}:is_color"]', "eval.samples=8"]
    arbor("sft", "model=tiny", f"data.train={f['sft.jsonl']}", tools, f"out={tmp_path / 'sft'}", "train.steps=300",
          "train.batch_tokens=2048", "train.optim.lr=3e-3", "train.checkpoint_every=0", "log.progress=false")
    shown = arbor("eval", tmp_path / "sft", *rows, "--n", 36)
    before = float(re.search(r"eval_reward (-?[0-9.]+)", shown).group(1))
    arbor("train", f"model={tmp_path / 'sft'}", f"out={tmp_path / 'rl'}", *rows, "steps=60", "eval_every=30",
          "eval_problems=36", "rollout.branch=[8]", "rollout.max_context=320", "c3po.token_budget=1200",
          "optim.lr=5e-5", "optim.warmup_steps=5", "optim.betas=[0.9,0.999]", "checkpoint_every=0", "log.progress=false")
    log = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in log if "eval_reward" in row]
    # eval_reward = correct + is_color per sample (0 to 2), over 36 held-out rows × 8 samples. Measured
    # with RL seeds 0, 1, 2, each with ATen/oneDNN at their best ISA (AVX-512/AMX) and capped at AVX2
    # (other float rounding, as another CPU gives): 1.35 to 1.38 after SFT, a rise of 0.22 to 0.38 after
    # 60 steps (median 0.34). At lr 1e-4 (and 40 steps) one run in three collapsed below its SFT start,
    # so lr is 5e-5. An estimate from 288 samples varies by about 0.05 (one standard deviation): a rise
    # of 0.1 is 2 of them above "no change" and under half the smallest rise measured.
    assert evals[-1]["eval_reward"] >= before + 0.1, (before, [row["eval_reward"] for row in evals])
    trained = [row for row in log if "reward" in row]
    assert all({"reward/rewards.correct", "reward/rewards.is_color", "reward_errors"} <= set(row) for row in trained)
    assert sum(row["reward_errors"] for row in trained) == 0
    table = [json.loads(line) for line in (tmp_path / "rl" / "samples.jsonl").read_text().splitlines()]
    assert [t["step"] for t in table] == [row["step"] for row in evals]
    assert {"prompt", "completion", "reward"} <= set(table[-1]["samples"][0])
