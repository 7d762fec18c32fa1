"""Built-in task: questions that are easy with a Python interpreter and hard without one.

The model calls the ``python`` tool with a program; the tool runs it in `arbor.rollout.sandbox` and
the "tool" message holds the program's stdout (or a one-line error / timeout); the model finishes
with "Answer: X". Written against the public API: ``rows``, the tool ``python``, ``reward``.

Families (each question states its conventions, e.g. F(0) = 0, F(1) = 1):
sums of k-th powers of 1..n, digit sums of a**b, counting primes below N, gcd / lcm of
several numbers, Fibonacci(n) mod m.

Invariants:
- `generate_problems` is a pure function of its arguments (no global RNG, no hash seed).
- Splits are a partition by a SHA-256 hash of the question text, so "train" and "test"
  never share a question for any seeds; questions are unique within one call.
- `answer` is the decimal integer that `solution` (a stdlib-only program) prints, computed
  here without the sandbox; the demonstration's tool turn is exactly `run_tool(solution)`.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from arbor.tasks.splits import split_of

from arbor.rollout.sandbox import SandboxConfig, check_isolation, run_python_async


SYSTEM_PROMPT = (
    "Solve the problem by writing Python. Pass a complete program to the python tool; "
    "it runs in a fresh interpreter (standard library only, no "
    "network, a few seconds of time), and its printed output comes back to you in a tool "
    "message, or the error if it failed. You may call the tool several times. When you know "
    "the result, reply with \"Answer: X\" and no tool call."
)


@dataclass(frozen=True)
class PythonProblem:
    question: str   # e.g. "What is the sum of the squares of the integers from 1 to 37?"
    answer: str     # e.g. "17575"
    solution: str = ""  # a reference program that prints `answer`




_POWER_NAMES = {2: "squares", 3: "cubes", 4: "fourth powers", 5: "fifth powers"}


def _sum_of_powers(rng: random.Random) -> PythonProblem:
    k, n = rng.randint(2, 5), rng.randint(20, 999)
    return PythonProblem(f"What is the sum of the {_POWER_NAMES[k]} of the integers from 1 to {n}?",
                         str(sum(i**k for i in range(1, n + 1))),
                         f"print(sum(i**{k} for i in range(1, {n} + 1)))")


def _digit_sum_of_power(rng: random.Random) -> PythonProblem:
    a, b = rng.randint(2, 99), rng.randint(50, 400)
    return PythonProblem(f"What is the sum of the decimal digits of {a}^{b}?",
                         str(sum(map(int, str(a**b)))),
                         f"print(sum(int(d) for d in str({a} ** {b})))")


def _count_primes(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"[:n]
    for p in range(2, math.isqrt(max(n - 1, 0)) + 1):
        if sieve[p]:
            sieve[p * p::p] = bytes(len(range(p * p, n, p)))
    return sum(sieve)


def _primes_below(rng: random.Random) -> PythonProblem:
    n = rng.randint(1_000, 200_000)
    code = (f"n = {n}\nsieve = bytearray([1]) * n\nsieve[:2] = b'\\x00\\x00'\n"
            "for p in range(2, int(n ** 0.5) + 1):\n"
            "    if sieve[p]:\n        sieve[p * p::p] = bytes(len(range(p * p, n, p)))\n"
            "print(sum(sieve))")
    return PythonProblem(f"How many prime numbers are less than {n}?", str(_count_primes(n)), code)


def _gcd_or_lcm(rng: random.Random) -> PythonProblem:
    common = rng.randint(2, 60)
    nums = [common * rng.randint(2, 400) for _ in range(rng.randint(3, 5))]
    listed = ", ".join(map(str, nums[:-1])) + f" and {nums[-1]}"
    if rng.random() < 0.5:
        return PythonProblem(f"What is the greatest common divisor of {listed}?",
                             str(math.gcd(*nums)), f"import math\nprint(math.gcd({', '.join(map(str, nums))}))")
    return PythonProblem(f"What is the least common multiple of {listed}?",
                         str(math.lcm(*nums)), f"import math\nprint(math.lcm({', '.join(map(str, nums))}))")


def _fibonacci_mod(rng: random.Random) -> PythonProblem:
    n, m = rng.randint(100, 20_000), rng.choice([1_000, 10_007, 65_536, 1_000_000, 998_244_353, 10**9 + 7])
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return PythonProblem(f"With F(0) = 0, F(1) = 1 and F(k) = F(k-1) + F(k-2), what is F({n}) mod {m}?",
                         str(a), f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {m}\nprint(a)")


FAMILIES = (_sum_of_powers, _digit_sum_of_power, _primes_below, _gcd_or_lcm, _fibonacci_mod)


def generate_problems(n: int, seed: int, split: str = "train") -> list[PythonProblem]:
    """`n` distinct problems of `split` ("train" or "test"), families drawn uniformly,
    deterministic in all arguments. Raises ValueError for a bad split or n < 0."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"arbor-python-tool:{seed}:{split}")
    seen, out = set(), []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            break
        p = rng.choice(FAMILIES)(rng)
        if p.question in seen or split_of(p.question) != split:
            continue
        seen.add(p.question)
        out.append(p)
    if len(out) < n:
        raise ValueError(f"could only find {len(out)} of {n} distinct {split} problems")
    return out


_ANSWER = re.compile(r"Answer:[ \t]*([^\n]*)")


def parse_answer(text: str) -> str | None:
    """What follows the last "Answer:" on its line, without surrounding space, "**", "$" or a
    final "."; None when there is no "Answer:"."""
    found = _ANSWER.findall(text)
    if not found:
        return None
    return found[-1].strip().rstrip(".").strip("*$` ").rstrip(".").strip()


def _as_int(s: str) -> int | None:
    s = s.replace(",", "").replace("_", "").replace(" ", "")
    return int(s) if re.fullmatch(r"[+-]?\d{1,4000}", s) else None


def is_correct(problem: PythonProblem, final_text: str) -> bool:
    """The last "Answer: X" matches: as integers when both parse ("17,575" == "17575"),
    else as stripped strings."""
    got = parse_answer(final_text)
    if got is None:
        return False
    a, b = _as_int(got), _as_int(problem.answer)
    return a == b if a is not None and b is not None else got == problem.answer.strip()


async def run_tool(code: str, config: SandboxConfig | None = None) -> str:
    """The sandbox's observation text for `code` (stdout, or "error: ..." / "timeout after Xs"); ``config``:
    the job's ``sandbox`` section (`arbor.rollout.sandbox.default_config`)."""
    return (await run_python_async(code, config)).as_observation()


def check_sandbox(config: SandboxConfig | None = None) -> None:
    """Raise ``SandboxUnavailable`` at once (when the task loads, not at the first tool call) if the
    sandbox would isolate weakly and ``config`` (or ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION=1) does not allow it,
    or ValueError if its declared packages do not import or its files are missing."""
    check_isolation(config)


async def python(code: str) -> str:
    """Run a Python program in a fresh sandboxed interpreter and return what it prints.

    Args:
        code: a complete program (standard library only, no network, a few seconds)
    """
    return await run_tool(code)


def reward(prompt, completion: str, answer, **row) -> float:
    return float(is_correct(PythonProblem(str(prompt), str(answer)), completion))


def demonstration(problem: PythonProblem) -> list[dict]:
    """The ideal solver's chat: system, user(question), an assistant turn calling ``python`` with the
    solution, tool (the solution's stdout: the answer and a newline), assistant "Answer: X"."""
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem.question},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "python", "arguments": {"code": problem.solution}}}]},
            {"role": "tool", "content": f"{problem.answer}\n"},
            {"role": "assistant", "content": f"Answer: {problem.answer}"}]


def rows(n: int, seed: int, split: str = "train") -> list[dict]:
    return [{"prompt": p.question, "answer": p.answer, "messages": demonstration(p)}
            for p in generate_problems(n, seed, split)]
