"""Built-in tasks by name, for both kinds of model.

``TASKS`` / ``get_task``: autoregressive (chat, tools) tasks; each gives seeded problems with
train/test splits, an environment per problem, a demonstration per problem (for SFT warm starts)
and a verifier. ``DIFFUSION_TASKS`` / ``get_diffusion_task``: the block-diffusion tasks (prompt →
answer decoded directly, no chat or tools): modules with ``GEN_LENGTH``, ``generate(n, seed, split)``
and ``score(problem, text)``; masked-diffusion SFT, TAD, EBPO and the dLLM benches read them here."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from arbor.rollout.environment import ToolEnvironment
from arbor.tasks import addition, countdown, sudoku


@dataclass
class Task:
    name: str
    generate: Callable[..., list]          # (n, seed, split) → problems
    make_env: Callable[[object], ToolEnvironment]
    demonstration: Callable[[object], list[dict]]
    is_correct: Callable[[object, str], bool]


def _reward(is_correct, problem, text: str) -> float:
    return float(is_correct(problem, text))


def arithmetic_task(max_turns: int = 6) -> Task:
    from arbor.tasks import arithmetic as ar

    def make_env(p):
        return ToolEnvironment(ar.SYSTEM_PROMPT, p.question, ar.calculator,
                               functools.partial(_reward, ar.is_correct, p), max_turns)

    return Task("arithmetic", ar.generate_problems, make_env, ar.demonstration, ar.is_correct)


COUNTDOWN_PROMPT = ("Combine the given numbers, each exactly once, with + - * (usual precedence, no parentheses) "
                    "to reach the target. You may check an expression with <tool_call>EXPR</tool_call>. "
                    "Finish with \"Answer: EXPR\".")


def _countdown_question(p) -> str:
    return f"Numbers: {', '.join(map(str, p.numbers))}. Target: {p.target}."


def _countdown_correct(p, text: str) -> bool:
    from arbor.tasks import countdown as cd
    answer = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else ""
    return cd.verify(p.numbers, p.target, answer)


def _countdown_demo(p) -> list[dict]:
    from arbor.tasks.arithmetic import calculator
    return [{"role": "system", "content": COUNTDOWN_PROMPT}, {"role": "user", "content": _countdown_question(p)},
            {"role": "assistant", "content": f"<tool_call>{p.answer}</tool_call>"},
            {"role": "tool", "content": calculator(p.answer)},
            {"role": "assistant", "content": f"Answer: {p.answer}"}]


def countdown_task(max_turns: int = 4) -> Task:
    """Countdown (3 numbers) as a tool task: the calculator checks candidates, the verifier the answer."""
    from arbor.tasks import countdown as cd
    from arbor.tasks.arithmetic import calculator

    def make_env(p):
        return ToolEnvironment(COUNTDOWN_PROMPT, _countdown_question(p), calculator,
                               functools.partial(_reward, _countdown_correct, p), max_turns)

    def generate(n, seed, split="train"):
        return cd.generate(n, seed=seed, split=split)

    return Task("countdown", generate, make_env, _countdown_demo, _countdown_correct)


def python_task() -> Task:
    """Problems that are easy with code: the model's tool calls run in the sandbox."""
    from arbor.tasks import python_tool as pt
    return Task("python", pt.generate_problems, pt.make_environment, pt.demonstration, pt.is_correct)


def longtail_task() -> Task:
    from arbor.tasks import longtail as lt
    return Task("longtail", lt.generate_problems, lt.LongTailEnvironment, lt.demonstration, lt.is_correct)


TASKS = {"arithmetic": arithmetic_task, "countdown": countdown_task, "python": python_task,
         "longtail": longtail_task}


DIFFUSION_TASKS = {"sudoku": sudoku, "addition": addition, "countdown": countdown}


def get_task(name: str) -> Task:
    if name not in TASKS:
        extra = f" ('{name}' is a block-diffusion task: train a dLLM on it)" if name in DIFFUSION_TASKS else ""
        raise ValueError(f"unknown task '{name}'; built-in tasks: {sorted(TASKS)}{extra}")
    return TASKS[name]()


def get_diffusion_task(name: str):
    """The block-diffusion task module ``name`` (see module docstring)."""
    if name not in DIFFUSION_TASKS:
        raise ValueError(f"task '{name}' has no diffusion version; a block-diffusion model trains on one of "
                         f"{sorted(DIFFUSION_TASKS)} (task=...)")
    return DIFFUSION_TASKS[name]
