"""A single-turn task with long-tailed output lengths, for rollout-system benchmarks.

Problem i asks for ``length_i`` repetitions of one letter; ``length_i`` is drawn from a
Pareto-like tail (most short, a few very long), and the episode's turn is generated with
exactly that many tokens (``max_turn_tokens = length_i``, EOS ignored). The reward per
character is ½·[c ∈ a…j] + ½·[c = asked letter], averaged over the output: dense and
verifiable, so a policy learns it from random init, while its rollout cost has a long tail.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

from arbor.rollout.environment import StepResult

LETTERS = "abcdefghij"


@dataclass(frozen=True)
class LongTailProblem:
    letter: str
    length: int

    @property
    def question(self) -> str:
        return f"Write the letter {self.letter} {self.length} times."


def generate_problems(n: int, seed: int, split: str = "train", min_len: int = 8, max_len: int = 256,
                      alpha: float = 1.2) -> list[LongTailProblem]:
    rng = random.Random(f"longtail/{seed}/{split}")
    return [LongTailProblem(rng.choice(LETTERS), min(max_len, int(min_len * rng.paretovariate(alpha))))
            for _ in range(n)]


def score(problem: LongTailProblem, text: str) -> float:
    return sum(0.5 * (c in LETTERS) + 0.5 * (c == problem.letter) for c in text) / max(1, len(text))


class LongTailEnvironment:
    """One model turn; reward = score. ``max_turn_tokens`` and ``ignore_eos`` fix its length (an
    environment of the public protocol, ``arbor.rollout.environment``: ``env=arbor.tasks.longtail:LongTailEnvironment``)."""
    system_prompt = "Follow the instruction."

    def __init__(self, problem: LongTailProblem | None = None):
        self.problem = problem
        self.max_turn_tokens = problem.length if problem else 1
        self.ignore_eos = True

    async def reset(self, row: dict | None = None) -> list[dict]:
        if row is not None:
            self.problem = LongTailProblem(row["letter"], int(row["length"]))
            self.max_turn_tokens = self.problem.length
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.problem.question}]

    async def step(self, message: dict) -> StepResult:
        return StepResult(None, self.score(message), True)

    def score(self, message: dict) -> float:
        return score(self.problem, message["content"])

    def fork(self) -> "LongTailEnvironment":
        return copy.copy(self)


def rows(n: int, seed: int, split: str = "train") -> list[dict]:
    return [{"prompt": p.question, "letter": p.letter, "length": p.length, "messages": demonstration(p)}
            for p in generate_problems(n, seed, split)]


def demonstration(problem: LongTailProblem) -> list[dict]:
    return [{"role": "system", "content": LongTailEnvironment.system_prompt},
            {"role": "user", "content": problem.question},
            {"role": "assistant", "content": problem.letter * problem.length}]


def is_correct(problem: LongTailProblem, text: str) -> bool:
    return score(problem, text) == 1.0
