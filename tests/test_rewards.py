"""Users' reward functions (``arbor.data.rewards``): the three forms, built-ins, weights, errors,
timeouts and the metrics of ``drain()``; real reward files written into ``tmp_path``."""

from __future__ import annotations

import asyncio
import logging
import math
import textwrap

import pytest

from arbor.data.rewards import RewardConfig, RewardError, Rewards, detect_form

GSM = {"question": "q", "answer": "She has 8 * 9 = <<8*9=72>>72 apples.\n#### 72"}

ARBOR = """
def correct(prompt, completion, **row):
    if "boom" in completion:
        raise RuntimeError("boom on purpose")
    return float(completion.strip() == row["answer"])

def nan(prompt, completion, **row):
    return float("nan") if completion == "nan" else 0.5

def text(prompt, completion, **row):
    return "high"

def only_answer(completion, answer):
    return float(answer in completion)
"""

TRL = """
import asyncio

def lengths(prompts, completions, **kwargs):
    return [None if k == "skip" else float(len(c if isinstance(c, str) else c[0]["content"]))
            for c, k in zip(completions, kwargs["kind"])]

async def async_match(prompts, completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

CALLS = []
def counted(completions, **kwargs):
    CALLS.append(len(completions))
    return [1.0] * len(completions)

def chat(prompts, completions, **kwargs):
    return [1.0 if isinstance(c, list) and c[0]["role"] == "assistant" else 0.0 for c in completions]

def short(prompts, completions, **kwargs):
    return [1.0]
"""

VERL = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ok = float(solution_str.strip() == str(ground_truth))
    return {"score": ok, "acc": ok, "source_is_gsm": float(data_source == "gsm8k"),
            "split_is_test": float((extra_info or {}).get("split") == "test")}

def plain(data_source, solution_str, ground_truth):
    return 2.0
"""

SLOW = """
import asyncio, time

def sleepy(prompt, completion, **row):
    time.sleep(0.5)
    return 1.0

async def async_sleepy(prompt, completion, **row):
    await asyncio.sleep(5)
    return 1.0
"""


def write(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(coro):
    return asyncio.run(coro)


def score_all(rewards: Rewards, items) -> list[float]:
    return run(rewards.score_batch(items))


def test_arbor_form_values_weights_and_means(tmp_path):
    f = write(tmp_path, "mine.py", ARBOR)
    r = Rewards(RewardConfig(fns=[f"{f}:correct", f"{f}:only_answer"], weights=[2.0, 0.5]))
    assert run(r.score("q", " 72 ", {"prompt": "q", "answer": "72"}, 0)) == 2.0 * 1 + 0.5 * 1
    assert run(r.score("q", "71", {"answer": "72"}, 1)) == 0.0
    m = r.drain()
    assert m == {"reward/mine.correct": 0.5, "reward/mine.only_answer": 0.5, "reward_errors": 0}
    assert r.drain() == {"reward_errors": 0}          # drained
    lines = r.describe()
    assert lines[0].startswith(f"reward '{f}:correct': Arbor form correct(prompt, completion, **row), per sample")
    assert "weight 2; logged as reward/mine.correct" in lines[0]


def test_trl_form_batched_async_none_and_columns_as_lists(tmp_path):
    f = write(tmp_path, "trl_rewards.py", TRL)
    r = Rewards(RewardConfig(fns=[f"{f}:lengths", f"{f}:async_match", f"{f}:counted"]))
    rows = [{"prompt": "p", "answer": "72", "kind": "a"}, {"prompt": "p", "answer": "5", "kind": "skip"},
            {"prompt": "p", "answer": "9", "kind": "a"}]
    items = [("p", "x72", rows[0], 0), ("p", "no", rows[1], 1), ("p", "9", rows[2], 2)]
    got = score_all(r, items)
    assert got == [3.0 + 1.0 + 1.0, 0.0 + 1.0, 1.0 + 1.0 + 1.0]       # None (row 1): left out, no error
    import sys
    module = next(m for n, m in sys.modules.items() if n.startswith("arbor_user_trl_rewards"))
    assert module.CALLS == [3]                                     # one call for the batch
    m = r.drain()
    assert m["reward/trl_rewards.lengths"] == 2.0 and m["reward_errors"] == 0   # mean over the 2 numbers
    assert m["reward/trl_rewards.async_match"] == pytest.approx(2 / 3)
    d = r.describe()
    assert "TRL form lengths(prompts, completions, **kwargs), batched" in d[0]
    assert d[1].endswith("logged as reward/trl_rewards.async_match") and ", batched, async;" in d[1]
    # score() is a batch of one; concurrent score() calls each give their own sample's value
    async def concurrently():
        return await asyncio.gather(*(r.score("p", c, row, i) for c, row, i in [("x72", rows[0], 0), ("9", rows[2], 2)]))
    assert run(concurrently()) == [5.0, 3.0]


def test_trl_conversational_completions_are_messages(tmp_path):
    f = write(tmp_path, "chat_rewards.py", TRL)
    r = Rewards(RewardConfig(fns=[f"{f}:chat"]))
    chat_prompt = [{"role": "user", "content": "hi"}]
    assert score_all(r, [(chat_prompt, "hello", {"prompt": chat_prompt}, 0), ("hi", "hello", {}, 1)]) == [1.0, 0.0]


def test_trl_wrong_length_is_an_error_for_every_sample(tmp_path):
    f = write(tmp_path, "short_rewards.py", TRL)
    r = Rewards(RewardConfig(fns=[f"{f}:short"]))
    assert score_all(r, [("p", "a", {}, 0), ("p", "b", {}, 1)]) == [0.0, 0.0]
    assert r.drain()["reward_errors"] == 2


def test_verl_form_dict_extras_and_ground_truth_columns(tmp_path):
    f = write(tmp_path, "verl_reward.py", VERL)
    r = Rewards(RewardConfig(fns=[f"{f}:compute_score", f"{f}:plain"], weights=[1.0, 0.25]))
    verl_row = {"prompt": [{"role": "user", "content": "q"}], "data_source": "gsm8k",
                "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "test"}}
    flat_row = {"prompt": "q", "ground_truth": 5}
    assert score_all(r, [(verl_row["prompt"], "72", verl_row, 0), ("q", "4", flat_row, 1)]) == [1.5, 0.5]
    m = r.drain()
    assert m["reward/verl_reward.compute_score"] == 0.5 and m["reward/verl_reward.plain"] == 2.0
    assert m["reward/verl_reward.compute_score/acc"] == 0.5
    assert m["reward/verl_reward.compute_score/source_is_gsm"] == 0.5
    assert m["reward/verl_reward.compute_score/split_is_test"] == 0.5
    assert "verl form compute_score(data_source, solution_str, ground_truth, extra_info=None), per sample" \
        in r.describe()[0]


def test_verl_without_ground_truth_names_the_columns(tmp_path, caplog):
    f = write(tmp_path, "verl_reward.py", VERL)
    r = Rewards(RewardConfig(fns=[f"{f}:plain"], on_error="fail"))
    with pytest.raises(RewardError, match=r"row 3: no ground truth.*\['answer', 'prompt'\]"):
        run(r.score("q", "x", {"prompt": "q", "answer": "1"}, 3))


@pytest.mark.parametrize("completion, value", [
    ("The answer is 72.", 1.0), ("Answer: 72", 1.0), ("\\boxed{72}", 1.0), ("9 * 8 = 72, so 72", 1.0),
    ("The answer is 71.", 0.0), ("Answer: 7", 0.0), ("\\boxed{27}", 0.0), ("I don't know", 0.0), ("", 0.0)])
def test_math_builtin_on_gsm8k_answers(completion, value):
    r = Rewards(RewardConfig(fns=["math"]))
    assert run(r.score("q", completion, GSM, 0)) == value
    assert r.drain()["reward_errors"] == 0


def test_math_builtin_other_answer_columns_and_missing():
    r = Rewards(RewardConfig(fns=["math"]))
    assert run(r.score("q", "so \\boxed{\\frac{1}{2}}", {"solution": "It is $\\boxed{\\frac12}$"}, 0)) == 1.0
    assert run(r.score("q", "0.5", {"ground_truth": "1/2"}, 1)) == 1.0
    assert run(r.score("q", "0.5", {"reward_model": {"ground_truth": "0.5"}}, 2)) == 1.0
    assert run(r.score("q", "72", {"question": "q"}, 3)) == 0.0
    assert r.drain()["reward_errors"] == 1


def test_exact_regex_and_length_penalty_builtins():
    r = Rewards(RewardConfig(fns=["exact"]))
    assert [run(r.score("q", c, GSM)) for c in ("72", "  72\n", "72.", "The answer is 72")] == [1.0, 1.0, 0.0, 0.0]
    r = Rewards(RewardConfig(fns=["regex:^<think>.*</think>", "regex:(?i)answer"]))
    assert run(r.score("q", "<think>x</think> ANSWER", {})) == 2.0
    assert run(r.score("q", "x <think>x</think>", {})) == 0.0
    assert sorted(r.drain()) == ["reward/regex", "reward/regex_2", "reward_errors"]
    r = Rewards(RewardConfig(fns=["length_penalty"], length_target=10))
    assert [run(r.score("q", "x" * n, {})) for n in (0, 10, 15, 20, 100)] == [0.0, 0.0, -0.5, -1.0, -1.0]


def test_timeout_counts_an_error_and_zero(tmp_path, caplog):
    f = write(tmp_path, "slow.py", SLOW)
    r = Rewards(RewardConfig(fns=[f"{f}:sleepy", f"{f}:async_sleepy", "exact"], timeout_s=0.2))
    with caplog.at_level(logging.WARNING, logger="arbor"):
        assert run(r.score("q", "72", GSM, 7)) == 1.0          # only `exact` counts
    assert r.drain()["reward_errors"] == 2
    assert "reward 'slow.sleepy'" in caplog.text and "row 7: timed out after 0.2 s" in caplog.text
    assert "reward errors since the last step: 2" in caplog.text


def test_exceptions_nan_and_non_numbers_are_counted_and_logged(tmp_path, caplog):
    f = write(tmp_path, "mine.py", ARBOR)
    r = Rewards(RewardConfig(fns=[f"{f}:correct", f"{f}:nan"]))
    items = [("q", "72", {"answer": "72"}, 0), ("q", "boom", {"answer": "72"}, 1), ("q", "nan", {"answer": "72"}, 2)]
    with caplog.at_level(logging.WARNING, logger="arbor"):
        assert score_all(r, items) == [1.5, 0.5, 0.0]
        m = r.drain()
    assert m["reward_errors"] == 2 and m["reward/mine.correct"] == 0.5 and m["reward/mine.nan"] == 0.5
    assert "reward 'mine.correct'" in caplog.text and "row 1: RuntimeError: boom on purpose" in caplog.text
    assert "row 2: returned nan" in caplog.text and "'answer': '72'" in caplog.text
    r = Rewards(RewardConfig(fns=[f"{f}:text"]))
    assert run(r.score("q", "x", {}, 4)) == 0.0 and r.drain()["reward_errors"] == 1


def test_error_logs_are_capped_per_drain(tmp_path, caplog):
    f = write(tmp_path, "mine.py", ARBOR)
    r = Rewards(RewardConfig(fns=[f"{f}:text"]))
    with caplog.at_level(logging.WARNING, logger="arbor"):
        score_all(r, [("q", "x", {}, i) for i in range(8)])
        assert r.drain()["reward_errors"] == 8
    assert caplog.text.count("failed on row") == 5
    assert "reward errors since the last step: 8 (mine.text: 8); 3 log lines at DEBUG level" in caplog.text


def test_signal_timeouts_in_the_worker_thread_get_a_hint(tmp_path, caplog):
    f = write(tmp_path, "mv.py", """
        from math_verify import parse, verify
        def acc(prompt, completion, answer, **row):
            return float(verify(parse(answer), parse(completion)))   # signal.alarm: main thread only
        """)
    r = Rewards(RewardConfig(fns=[f"{f}:acc"]))
    with caplog.at_level(logging.WARNING, logger="arbor"):
        assert run(r.score("q", "72", {"answer": "72"}, 0)) == 0.0
    assert "sync rewards run in a worker thread" in caplog.text and r.drain()["reward_errors"] == 1


def test_on_error_fail_raises_with_function_and_row(tmp_path):
    f = write(tmp_path, "mine.py", ARBOR)
    r = Rewards(RewardConfig(fns=[f"{f}:correct"], on_error="fail"))
    assert run(r.score("q", "72", {"answer": "72"}, 0)) == 1.0
    with pytest.raises(RewardError, match=r"reward 'mine.correct' .* failed on row 12: RuntimeError: boom"):
        run(r.score("q", "boom", {"answer": "72"}, 12))
    assert issubclass(RewardError, ValueError)


BAD_FILES = {
    "raises.py": "raise ImportError('no such dependency')\n",
    "notcallable.py": "reward = 3\n",
    "wrong.py": "def f(x):\n    return 1.0\n\ndef both(prompt, completions):\n    return [1.0]\n\n"
                "def ids(prompts, completions, completion_ids):\n    return [1.0]\n\n"
                "def extra(data_source, solution_str, ground_truth, tokenizer):\n    return 1.0\n",
}


@pytest.mark.parametrize("spec, message", [
    ("{d}/missing.py:f", r"no file .*missing\.py"),
    ("{d}/raises.py:f", r"importing .*raises\.py failed: ImportError: no such dependency"),
    ("{d}/notcallable.py:reward", r"is a int, not a function"),
    ("{d}/notcallable.py:other", r"has no 'other'"),
    ("{d}/wrong.py:f", r"reward '.*wrong\.py:f' has parameters \(x\): it matches none of them; the accepted forms"),
    ("{d}/wrong.py:both", r"names of the Arbor and TRL forms.*\n  Arbor: f\(prompt, completion, \*\*row\)"),
    ("{d}/wrong.py:ids", r"cannot pass \['completion_ids'\] to a TRL-form function"),
    ("{d}/wrong.py:extra", r"cannot pass \['tokenizer'\] to a verl-form function"),
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
    ("regex:(unclosed", r"reward 'regex:\(unclosed': bad regular expression '\(unclosed'"),
    ("regex:", r"empty pattern"),
    ("accuracy", r"'accuracy' is neither a built-in \(math, exact, length_penalty, regex:PATTERN\)"),
])
def test_bad_specs_are_value_errors_naming_them(tmp_path, spec, message):
    for name, body in BAD_FILES.items():
        (tmp_path / name).write_text(body)
    with pytest.raises(ValueError, match=message):
        Rewards(RewardConfig(fns=[spec.format(d=tmp_path)]))


def test_config_validation():
    for cfg, message in [(RewardConfig(fns=["math", "exact"], weights=[1.0]), r"weights must be empty .* one per fn \(2\)"),
                         (RewardConfig(fns=["math"], weights=[math.nan]), "weights must be finite"),
                         (RewardConfig(timeout_s=0), "timeout_s must be > 0"),
                         (RewardConfig(on_error="ignore"), "on_error must be one of"),
                         (RewardConfig(length_target=0), "length_target must be ≥ 1")]:
        with pytest.raises(ValueError, match=message):
            cfg.validate()
    RewardConfig(fns=["math", "regex:a+"], weights=[1.0, -0.5]).validate()
    r = Rewards(RewardConfig())
    assert run(r.score("q", "x", {})) == 0.0 and r.drain() == {"reward_errors": 0}


def test_form_detection_of_plain_signatures():
    def arbor(prompt, completion, answer=None): ...
    def trl(completions, **kwargs): ...
    async def verl(data_source, solution_str, ground_truth, extra_info=None): ...
    assert detect_form(arbor, "a")[0] == "Arbor" and detect_form(trl, "t")[0] == "TRL"
    assert detect_form(verl, "v")[0] == "verl"
    with pytest.raises(ValueError, match="matches none"):
        detect_form(lambda prompts: None, "p")


def test_math_builtin_imports_math_verify_in_the_background_outside_timeout_s():
    """Building the ``math`` reward does not import math-verify (≈ 0.5 s of start-up); the first score
    does, on a daemon thread, and that import is not counted in the call's ``timeout_s`` (a fresh
    interpreter, so the import is really paid)."""
    import subprocess
    import sys
    code = textwrap.dedent("""
        import asyncio, sys, time
        from arbor.data.rewards import RewardConfig, Rewards
        r = Rewards(RewardConfig(fns=["math"], timeout_s=0.05))
        assert "math_verify" not in sys.modules, "imported at build"
        t = time.perf_counter()
        got = asyncio.run(r.score("q", "The answer is 72.", {"answer": "#### 72"}, 0))
        took = time.perf_counter() - t
        assert got == 1.0 and r.drain()["reward_errors"] == 0, got
        assert took > 0.05, took          # the import was paid here, and the call still counted
        print("ok")
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
