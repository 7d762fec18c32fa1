"""Countdown (3 numbers) as a chat task with the calculator tool: the model may check candidate
expressions with ``calc`` and finishes with "Answer: EXPR"; the reward checks that EXPR uses each
number once and reaches the target (``arbor.tasks.countdown.verify``)."""

from __future__ import annotations

from arbor.tasks import countdown as cd
from arbor.tasks.arithmetic import calculator, tool_call

SYSTEM_PROMPT = ("Combine the given numbers, each exactly once, with + - * (usual precedence, no parentheses) "
                 "to reach the target. You may check an expression with the calc tool. Finish with \"Answer: EXPR\".")


def question(numbers, target) -> str:
    return f"Numbers: {', '.join(map(str, numbers))}. Target: {target}."


def reward(prompt, completion: str, numbers, target, **row) -> float:
    answer = completion.rsplit("Answer:", 1)[-1] if "Answer:" in completion else ""
    return float(cd.verify(tuple(numbers), int(target), answer))


def rows(n: int, seed: int, split: str = "train") -> list[dict]:
    """``n`` rows: ``prompt``, ``numbers``, ``target`` and the ideal solver's ``messages`` (one calc call)."""
    out = []
    for p in cd.generate(n, seed=seed, split=split):
        q = question(p.numbers, p.target)
        demo = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q},
                tool_call("calc", {"expr": p.answer}), {"role": "tool", "content": calculator(p.answer)},
                {"role": "assistant", "content": f"Answer: {p.answer}"}]
        out.append({"prompt": q, "numbers": list(p.numbers), "target": p.target, "messages": demo})
    return out
