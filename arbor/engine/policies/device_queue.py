"""An in-order device queue on CPU: one worker thread runs submitted operations one at a time, in
submission order — as kernels run on a GPU stream.

Two uses in P/D multiplexing (``pd_runtime``):

- the rank's collective queue: every expert-parallel collective of the rank runs through one queue
  (``DistContext.run``). gloo process groups each have their own sockets and threads, so on CPU two
  executors that issue collectives on private groups in crossed orders would never block each
  other; on a device they do (a collective launched first occupies the stream until its peers
  arrive, and one launched after it cannot start). One in-order queue per rank makes that hazard —
  and the turnstile that prevents it — real on CPU.
- the prefill and decode workers: each a queue whose thread first runs ``init`` (its CPU thread
  budget, ``arbor.kernels.threads``), then the jobs of its phase.

``reserve(owner)``: until ``release()``, only ``owner``'s submissions enter the queue and every other
thread's ``submit`` waits — the decode step granted at a turnstile boundary is queued whole before
the next prefill segment's collectives, on every rank alike.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class DeviceQueue:
    def __init__(self, name: str = "device", init=None):
        self.name = name
        self._jobs: queue.Queue = queue.Queue()
        self._turn = threading.Condition()
        self._owner: threading.Thread | None = None
        self._worker = threading.Thread(target=self._run, args=(init,), name=f"{name}-queue", daemon=True)
        self._worker.start()

    @property
    def thread(self) -> threading.Thread:
        """The worker thread that runs the jobs."""
        return self._worker

    def _run(self, init) -> None:
        if init is not None:
            init()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:       # the caller sees it from future.result()
                    future.set_exception(e)

    def submit(self, fn) -> Future:
        """Queue ``fn()`` behind everything submitted before (waiting while another thread holds the
        queue, ``reserve``); → its Future."""
        with self._turn:
            me = threading.current_thread()
            self._turn.wait_for(lambda: self._owner is None or self._owner is me)
            future: Future = Future()
            self._jobs.put((fn, future))
        return future

    def run(self, fn):
        """Submit and wait: ``fn()``'s result, in queue order."""
        return self.submit(fn).result()

    def reserve(self, owner: threading.Thread) -> None:
        """Only ``owner`` may submit until ``release()``; the others wait in ``submit``."""
        with self._turn:
            if self._owner is not None:
                raise RuntimeError(f"{self.name} queue: already held by {self._owner.name}")
            self._owner = owner

    def release(self) -> None:
        with self._turn:
            self._owner = None
            self._turn.notify_all()

    @property
    def held(self) -> bool:
        return self._owner is not None

    def close(self) -> None:
        self._jobs.put(None)
