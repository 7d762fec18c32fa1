"""Per-thread CPU thread budgets: several executors of one process (the prefill and decode workers of
P/D multiplexing) each compute with their own number of cores, as P and D split a GPU's SMs.

What torch gives (measured, torch 2.13 CPU wheel, libgomp, 2 cores; ``torch.set_num_threads`` called
inside each thread):

- MKL GEMMs (``F.linear``, ``matmul``) follow the calling thread's setting (``mkl_set_num_threads_local``):
  per-thread;
- ATen's element-wise and reduction kernels (``at::parallel_for``) follow the process-global count,
  i.e. the last ``set_num_threads`` of any thread;
- Arbor's C kernels (paged attention, routed experts) take their thread count as an argument: they read
  ``thread_budget()``, which is per-thread once ``set_thread_budget`` ran on that thread.

So a budget is exact for GEMMs and Arbor's kernels; ATen's element-wise work follows whichever
budget was set last (with equal budgets, e.g. ``1,1``, every kernel follows its thread's).
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def set_thread_budget(n: int) -> None:
    """This thread computes with ``n`` threads from now on (see module docstring for what follows it)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"a thread budget must be an integer >= 1, got {n!r}")
    _local.n = n
    torch.set_num_threads(n)


def thread_budget() -> int:
    """The threads this thread's kernels may use: its ``set_thread_budget``, else torch's global count."""
    return getattr(_local, "n", 0) or torch.get_num_threads()
