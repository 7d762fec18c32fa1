"""``take_rows``: rows of a tensor by an index tensor, with a backward that is the same every run.

``x[idx]`` differentiates through ``index_put_(accumulate=True)``, which on a CPU with several
threads adds the gradients of repeated indices (a token shared by several tree branches, a key
gathered by several runs) in an order that changes from run to run: the same step gives weights
that differ in the last bits. ``index_select``'s backward (``index_add_``) adds them in index
order, bit for bit the same every run at a given thread count, and is faster on CPU.
"""

from __future__ import annotations

import torch


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for an integer ``idx`` of any shape: → [*idx.shape, *x.shape[1:]]."""
    return x.index_select(0, idx.reshape(-1)).reshape(*idx.shape, *x.shape[1:])
