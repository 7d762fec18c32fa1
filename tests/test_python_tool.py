"""The python-tool task: deterministic disjoint splits, demonstrations whose code really prints
the answer in the sandbox, and the "Answer: X" verifier."""

import asyncio

import pytest

from arbor.rollout.sandbox import SandboxConfig
from arbor.tasks.python_tool import (PythonProblem, demonstration, generate_problems, is_correct,
                                     check_sandbox, parse_answer, run_tool)


def test_generation_is_deterministic_and_varied():
    a, b = generate_problems(40, seed=3), generate_problems(40, seed=3)
    assert a == b and a != generate_problems(40, seed=4)
    assert len({p.question for p in a}) == 40
    starts = {p.question.split(" of ")[0].split(" are ")[0] for p in a}
    assert len(starts) >= 4     # several families, not one
    assert all(p.answer.lstrip("-").isdigit() for p in a)


def test_splits_are_disjoint():
    train = {p.question for s in range(3) for p in generate_problems(200, seed=s, split="train")}
    test = {p.question for s in range(3) for p in generate_problems(100, seed=s, split="test")}
    assert train and test and not train & test
    with pytest.raises(ValueError):
        generate_problems(1, seed=0, split="dev")


def test_known_answer():
    assert is_correct(PythonProblem("sum of squares 1..37", "17575"), "Answer: 17575")
    assert sum(i * i for i in range(1, 38)) == 17575


def test_demonstrations_run_in_the_sandbox_and_print_the_answer():
    problems = generate_problems(10, seed=0) + generate_problems(5, seed=0, split="test")
    cfg = SandboxConfig(timeout_s=10.0)

    async def main():
        demos = [demonstration(p) for p in problems]
        outs = await asyncio.gather(*(run_tool(d[2]["tool_calls"][0]["function"]["arguments"]["code"], cfg) for d in demos))
        return demos, outs
    demos, outs = asyncio.run(main())
    for p, d, out in zip(problems, demos, outs):
        assert [m["role"] for m in d] == ["system", "user", "assistant", "tool", "assistant"]
        assert d[1]["content"] == p.question
        assert out == d[3]["content"] == p.answer + "\n", (p.question, out)
        assert is_correct(p, d[4]["content"])


def test_verifier():
    p = PythonProblem("q", "17575")
    assert is_correct(p, "Let me think. Answer: 12\nActually, Answer: 17575")
    assert is_correct(p, "Answer: **17,575**.") and is_correct(p, "Answer:17575")
    assert not is_correct(p, "Answer: 17575\nAnswer: 12")
    assert not is_correct(p, "The result is 17575.") and not is_correct(p, "Answer: 17575.5")
    assert not is_correct(p, "Answer: ") and parse_answer("no answer") is None
    assert is_correct(PythonProblem("q", "abc"), "Answer: abc ") and not is_correct(PythonProblem("q", "abc"), "Answer: abd")


def test_run_tool_reports_errors_and_environment_rewards():
    assert asyncio.run(run_tool("1/0")).startswith("error:")
    p = generate_problems(1, seed=5)[0]

    from arbor.data.config import DataConfig
    from arbor.data.rewards import RewardConfig
    from arbor.tasks.registry import load_task
    task = load_task(task="python", data=DataConfig(), reward=RewardConfig(), tools=[], env="", seed=5, n_train=1, n_eval=1)
    row = {"prompt": p.question, "answer": p.answer}

    async def episode():
        env = task.make_env()
        await env.reset(row)
        obs, reward, done = await env.step(demonstration(p)[2])
        assert ([m["content"] for m in obs], reward, done) == ([p.answer + "\n"], 0.0, False)
        return await env.step({"role": "assistant", "content": f"Answer: {p.answer}"})
    _, reward, done = asyncio.run(episode())
    assert done and reward == 1.0


def test_the_environment_refuses_weak_isolation_up_front(monkeypatch):
    from arbor.rollout.sandbox import SandboxUnavailable
    monkeypatch.delenv("ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION", raising=False)
    problem = generate_problems(1, seed=0)[0]
    with pytest.raises(SandboxUnavailable, match="allow_weak_isolation"):
        check_sandbox(SandboxConfig(isolation="none"))
    check_sandbox(SandboxConfig(isolation="none", allow_weak_isolation=True))
    assert problem
