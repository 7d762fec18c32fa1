"""An in-order device queue on CPU: one worker thread per rank runs submitted operations one at a
time, in submission order — as kernels run on a GPU stream.

Why: gloo process groups each have their own sockets and threads, so on CPU two executors that
issue collectives on private groups in crossed orders never block each other. On a device they
do: a collective launched first occupies the stream until its peers arrive, and one launched after
it cannot start. Routing every collective of a rank through one ``DeviceQueue`` reproduces that, so
the hazards of P/D multiplexing (and the turnstile that prevents them) are real on CPU too.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class DeviceQueue:
    def __init__(self, name: str = "device"):
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"{name}-queue", daemon=True)
        self._worker.start()

    def _run(self) -> None:
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
        """Queue ``fn()`` behind everything submitted before; → its Future."""
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def run(self, fn):
        """Submit and wait: ``fn()``'s result, in queue order."""
        return self.submit(fn).result()

    def close(self) -> None:
        self._jobs.put(None)
