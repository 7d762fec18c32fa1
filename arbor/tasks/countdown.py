"""Countdown with 3 numbers: prompt ``"countdown:3,7,12>33="``, answer an expression that uses each
number exactly once with ``+ - *`` (usual precedence, no parentheses), e.g. ``"3*7+12"``.

API: ``solve(numbers, target)`` → the first solution in a fixed enumeration order (permutations of
the numbers × operator pairs) or None; ``verify(numbers, target, expression)`` → bool, never raises,
never calls eval(). Invariants: every generated problem has ``solve(...) == problem.answer`` and
``verify(..., problem.answer)``; ``generate`` is pure; "train"/"test" partition by prompt hash.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

from arbor.tasks.splits import split_of

GEN_LENGTH = 10          # up to 8 characters of expression, then the stop token (padding)
OPS = "+-*"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    numbers: tuple[int, ...]
    target: int




def evaluate(tokens: list) -> int:
    """[n0, op1, n1, op2, n2, …] with * before + and −."""
    terms, signs, cur = [], [1], tokens[0]
    for op, n in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            cur *= n
        else:
            terms.append(cur)
            signs.append(1 if op == "+" else -1)
            cur = n
    terms.append(cur)
    return sum(s * t for s, t in zip(signs, terms))


def solve(numbers, target: int) -> str | None:
    for perm in itertools.permutations(numbers):
        for ops in itertools.product(OPS, repeat=len(numbers) - 1):
            tokens = [perm[0]] + [x for pair in zip(ops, perm[1:]) for x in pair]
            if evaluate(tokens) == target:
                return "".join(map(str, tokens))
    return None


def verify(numbers, target: int, expression: str) -> bool:
    expr = expression.strip()
    if not re.fullmatch(r"\d+([+\-*]\d+)*", expr):
        return False
    parts = re.split(r"([+\-*])", expr)
    used = [int(p) for p in parts[::2]]
    if sorted(used) != sorted(numbers):
        return False
    return evaluate([int(p) if i % 2 == 0 else p for i, p in enumerate(parts)]) == target


def generate(n: int, seed: int = 0, split: str = "train", max_number: int = 20) -> list[Problem]:
    """``n`` distinct solvable problems with 3 numbers in 1..max_number and a target in 1..999."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"arbor-countdown:{seed}:{split}")
    seen, out = set(), []
    for _ in range(100 * n + 100):
        if len(out) == n:
            return out
        nums = tuple(rng.randint(1, max_number) for _ in range(3))
        tokens = [nums[0], rng.choice(OPS), nums[1], rng.choice(OPS), nums[2]]
        target = evaluate(tokens)
        prompt = f"countdown:{','.join(map(str, nums))}>{target}="
        if not 0 < target < 1000 or prompt in seen or split_of(prompt) != split:
            continue
        seen.add(prompt)
        out.append(Problem(prompt, solve(nums, target), nums, target))
    raise ValueError(f"could only find {len(out)} of {n} distinct {split} problems")


def score(problem: Problem, text: str) -> float:
    return float(verify(problem.numbers, problem.target, text))
