"""A single-turn task with long-tailed output lengths, for rollout-system benchmarks.

Problem i asks for ``length_i`` repetitions of one letter; ``length_i`` is drawn from a
Pareto-like tail (most short, a few very long), and the episode's turn is generated with
exactly that many tokens (``max_turn_tokens = length_i``, EOS ignored). The reward per
character is ½·[c ∈ a…j] + ½·[c = asked letter], averaged over the output: dense and
verifiable, so a policy learns it from random init, while its rollout cost has a long tail.
"""

from __future__ import annotations

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
    """One model turn; reward = score. ``max_turn_tokens`` and ``ignore_eos`` fix its length."""
    system_prompt = "Follow the instruction."

    def __init__(self, problem: LongTailProblem):
        self.problem = problem
        self.max_turn_tokens = problem.length
        self.ignore_eos = True

    async def reset(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.problem.question}]

    async def step(self, action: str) -> StepResult:
        return StepResult(None, score(self.problem, action), True)

    def verify(self, action: str) -> float:
        return score(self.problem, action)

    def fork(self) -> "LongTailEnvironment":
        return LongTailEnvironment(self.problem)


def demonstration(problem: LongTailProblem) -> list[dict]:
    return [{"role": "system", "content": LongTailEnvironment.system_prompt},
            {"role": "user", "content": problem.question},
            {"role": "assistant", "content": problem.letter * problem.length}]


def is_correct(problem: LongTailProblem, text: str) -> bool:
    return score(problem, text) == 1.0
