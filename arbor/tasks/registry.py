"""Built-in tasks by name: each gives seeded problems with train/test splits, an environment per
problem, a demonstration per problem (for SFT warm starts) and a verifier."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from arbor.rollout.environment import ToolEnvironment


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


def longtail_task() -> Task:
    from arbor.tasks import longtail as lt
    return Task("longtail", lt.generate_problems, lt.LongTailEnvironment, lt.demonstration, lt.is_correct)


TASKS = {"arithmetic": arithmetic_task, "longtail": longtail_task}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]()
