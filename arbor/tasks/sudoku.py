"""4×4 Sudoku for diffusion LMs: prompt ``"sudoku:12.4..1.....3..2="`` (16 cells row by row, ``.``
blank), answer the 16 digits of the solution.

Invariants:
- every generated puzzle has exactly one solution (checked by ``count_solutions``), so the score
  against the stored solution equals the score against any valid completion;
- ``generate`` is a pure function of its arguments; "train" and "test" are a partition by a
  SHA-256 hash of the prompt;
- ``score`` = correctly filled blank cells ÷ blank cells (the spec's Sudoku score), in [0, 1].
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from arbor.tasks.splits import split_of

GEN_LENGTH = 20          # 16 digits, then the stop token (padding)
_BASE = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str          # 16 digits




def _units():
    rows = [[4 * r + c for c in range(4)] for r in range(4)]
    cols = [[4 * r + c for r in range(4)] for c in range(4)]
    boxes = [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
    return rows + cols + boxes


UNITS = _units()


def is_valid(grid: list[int]) -> bool:
    """A complete grid (16 ints) with every row, column and 2×2 box a permutation of 1..4."""
    return len(grid) == 16 and all(sorted(grid[i] for i in u) == [1, 2, 3, 4] for u in UNITS)


def count_solutions(cells: list[int], limit: int = 2) -> int:
    """Completions of ``cells`` (0 = blank), counted up to ``limit``."""
    if 0 not in cells:
        return int(is_valid(cells))
    i = cells.index(0)
    n = 0
    for d in range(1, 5):
        if all(cells[j] != d for u in UNITS if i in u for j in u):
            cells[i] = d
            n += count_solutions(cells, limit - n)
            cells[i] = 0
            if n >= limit:
                break
    return n


def _random_grid(rng: random.Random) -> list[int]:
    digits = rng.sample(range(1, 5), 4)
    bands = rng.sample([0, 2], 2)
    rows = [b + r for b in bands for r in rng.sample([0, 1], 2)]
    stacks = rng.sample([0, 2], 2)
    cols = [s + c for s in stacks for c in rng.sample([0, 1], 2)]
    grid = [[digits[_BASE[r][c] - 1] for c in cols] for r in rows]
    if rng.random() < 0.5:
        grid = [list(x) for x in zip(*grid)]
    return [v for row in grid for v in row]


def _puzzle(rng: random.Random, min_blanks: int, max_blanks: int) -> Problem:
    solution = _random_grid(rng)
    cells = list(solution)
    target = rng.randint(min_blanks, max_blanks)
    for i in rng.sample(range(16), 16):
        if sum(c == 0 for c in cells) >= target:
            break
        keep, cells[i] = cells[i], 0
        if count_solutions(list(cells)) != 1:
            cells[i] = keep
    prompt = "sudoku:" + "".join(str(c) if c else "." for c in cells) + "="
    return Problem(prompt, "".join(map(str, solution)))


def generate(n: int, seed: int = 0, split: str = "train", min_blanks: int = 8, max_blanks: int = 12) -> list[Problem]:
    """``n`` distinct uniquely-solvable puzzles of ``split`` with min..max blank cells (fewer when no
    further cell can be blanked without a second solution; 12 blanks = 4 givens is the 4×4 limit)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"arbor-sudoku:{seed}:{split}")
    seen, out = set(), []
    for _ in range(100 * n + 100):
        if len(out) == n:
            return out
        p = _puzzle(rng, min_blanks, max_blanks)
        if p.prompt not in seen and split_of(p.prompt) == split:
            seen.add(p.prompt)
            out.append(p)
    raise ValueError(f"could only find {len(out)} of {n} distinct {split} puzzles")


def score(problem: Problem, text: str) -> float:
    """Fraction of the puzzle's blank cells that ``text`` fills with the solution's digit."""
    blanks = [i for i, c in enumerate(problem.prompt[7:23]) if c == "."]
    got = text[:16]
    return sum(i < len(got) and got[i] == problem.answer[i] for i in blanks) / max(1, len(blanks))
