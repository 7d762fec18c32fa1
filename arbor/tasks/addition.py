"""Multi-digit addition: prompt ``"add:00000482+00000037="``, answer the sum's digits ``"000000519"`` —
operands zero-padded to ``WIDTH`` digits and the sum to ``WIDTH + 1``, so digit i of the answer lines up with
digit i of the operands; most significant first, so each digit depends on the carries from the right
(the known stress test for confident parallel decoding).

Invariants: ``generate`` is a pure function of its arguments; "train"/"test" are a partition by a
SHA-256 hash of the prompt; ``score`` is 1.0 iff the text up to the stop is exactly the sum.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from arbor.tasks.splits import split_of

WIDTH = 8                # operand digits (zero-padded)
GEN_LENGTH = WIDTH + 3   # WIDTH + 1 digits of the sum, then the stop token (padding)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    a: int
    b: int




def generate(n: int, seed: int = 0, split: str = "train", min_digits: int = 1, max_digits: int = WIDTH) -> list[Problem]:
    """``n`` distinct problems a + b of ``split``, each operand with min..max (≤ WIDTH) digits."""
    if not 1 <= min_digits <= max_digits <= WIDTH:
        raise ValueError(f"need 1 ≤ min_digits ≤ max_digits ≤ {WIDTH}, got {min_digits}, {max_digits}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"arbor-addition:{seed}:{split}")
    seen, out = set(), []
    for _ in range(100 * n + 100):
        if len(out) == n:
            return out
        a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1)
                for d in (rng.randint(min_digits, max_digits), rng.randint(min_digits, max_digits)))
        prompt = f"add:{a:0{WIDTH}d}+{b:0{WIDTH}d}="
        if prompt not in seen and split_of(prompt) == split:
            seen.add(prompt)
            out.append(Problem(prompt, f"{a + b:0{WIDTH + 1}d}", a, b))
    raise ValueError(f"could only find {len(out)} of {n} distinct {split} problems; widen the digit range")


def score(problem: Problem, text: str) -> float:
    return float(text.strip() == problem.answer)
