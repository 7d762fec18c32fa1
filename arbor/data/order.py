"""The order a run visits its rows in: epoch after epoch, each a seeded permutation.

Draw ``k`` (0, 1, 2, …; on several ranks rank r takes k = i·W + r) is row ``order(epoch)[k mod n]``
with epoch = k // n, so the position of a run is the single counter k: a checkpoint that stores it
resumes on exactly the rows an uninterrupted run would see, and every row is seen once per epoch.
"""

from __future__ import annotations

import random
from functools import lru_cache


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"arbor-rows/{seed}/{epoch}").shuffle(order)
    return tuple(order)


def row_index(k: int, n: int, seed: int, shuffle: bool = True) -> int:
    """The row of draw ``k`` over ``n`` rows (module docstring)."""
    if n < 1:
        raise ValueError("no training rows: set data.train=PATH (data.eval rows are only evaluated)")
    return _permutation(n, seed, k // n)[k % n] if shuffle else k % n


def epoch_of(k: int, n: int) -> float:
    """Epochs done after ``k`` draws (fractional)."""
    return k / max(1, n)
