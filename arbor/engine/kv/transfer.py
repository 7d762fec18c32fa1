"""The copy engine of layer-wise KV: one worker thread (on CUDA it issues its copies on its own
stream) that runs KV copies between the device and host tiers while the model computes.

Jobs run in submission order (FIFO), so a job that writes a buffer runs after every job submitted
before it that reads it. ``submit(fn, nbytes, kind)`` → a ``Job``; ``wait(job)`` blocks the caller
until the job ran (on CUDA it also makes the caller's stream wait for the copy stream's work).
On CUDA a job starts only after the compute stream reached the point where it was submitted
(an event recorded at submission), so a prefetch never overwrites staging blocks a kernel still reads.

Measured: ``bytes`` per kind (``offload``: an offloaded layer's new KV, device → host; ``writeback``:
a resident layer's blocks leaving the device tier, device → host; ``prefetch``: host → device), ``busy_s``
(seconds the worker spent copying), ``wait_s`` (seconds callers were blocked in ``wait``);
``overlap = 1 − wait_s / busy_s`` is the fraction of copy time hidden behind compute.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

import torch


class Job:
    __slots__ = ("fn", "nbytes", "kind", "done", "error", "start_event", "end_event")

    def __init__(self, fn, nbytes: int, kind: str):
        self.fn, self.nbytes, self.kind = fn, nbytes, kind
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.start_event = self.end_event = None


_LIVE: "weakref.WeakSet[Copier]" = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    """Stop and join every worker before the interpreter tears torch down: a worker still alive in
    its queue at exit aborted the process now and then ("terminate called without an active
    exception", exit 134)."""
    for copier in list(_LIVE):
        copier.close()
        copier.thread.join(5)


class Copier:
    def __init__(self, device, inline_bytes: int = 0):
        self.device = torch.device(device)
        self.inline_bytes = inline_bytes
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.bytes = {"offload": 0, "writeback": 0, "prefetch": 0}
        self.busy_s = self.wait_s = 0.0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Job | None = None       # the last job handed to the worker
        self.thread = threading.Thread(target=self._work, name="kv-copy", daemon=True)
        self.thread.start()
        _LIVE.add(self)

    def submit(self, fn, nbytes: int, kind: str) -> Job:
        """Queue ``fn()`` (a few tensor copies) on the worker; → its job. On CPU a copy smaller than
        ``inline_bytes`` runs at once on the calling thread (a hand-off to the worker costs more) when
        the worker is idle, so jobs still run in submission order."""
        job = Job(fn, nbytes, kind)
        idle = self._last is None or self._last.done.is_set()
        if not self.cuda and nbytes < self.inline_bytes and idle:
            t0 = time.perf_counter()
            fn()
            self.busy_s += time.perf_counter() - t0
            self.wait_s += time.perf_counter() - t0
            self.bytes[kind] += nbytes
            job.done.set()
            return job
        if self.cuda:
            job.start_event = torch.cuda.Event()
            job.start_event.record(torch.cuda.current_stream(self.device))
        self._last = job
        self._q.put(job)
        return job

    def wait(self, job: Job | None) -> None:
        if job is None:
            return
        if not job.done.is_set():
            t0 = time.perf_counter()
            job.done.wait()
            self.wait_s += time.perf_counter() - t0
        if job.error is not None:
            raise RuntimeError(f"KV {job.kind} copy failed") from job.error
        if job.end_event is not None:
            torch.cuda.current_stream(self.device).wait_event(job.end_event)

    @property
    def overlap(self) -> float:
        """Fraction of the worker's copy time during which the compute thread was not waiting."""
        return 1.0 - min(1.0, self.wait_s / self.busy_s) if self.busy_s > 0 else 1.0

    def stats(self) -> dict:
        return {"offload_bytes": self.bytes["offload"], "writeback_bytes": self.bytes["writeback"],
                "prefetch_bytes": self.bytes["prefetch"],
                "copy_busy_s": self.busy_s, "copy_wait_s": self.wait_s, "overlap": self.overlap}

    def bandwidth(self) -> float | None:
        """Measured bytes per second of the worker (None before any copy)."""
        total = sum(self.bytes.values())
        return total / self.busy_s if self.busy_s > 0 and total else None

    def close(self) -> None:
        """Stop the worker once the jobs queued before are done."""
        self._q.put(None)

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._run(job)
            except BaseException as e:   # handed to the waiting thread
                job.error = e
            self.busy_s += time.perf_counter() - t0
            self.bytes[job.kind] += job.nbytes
            job.done.set()

    def _run(self, job: Job) -> None:
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(job.start_event)
                job.fn()
                job.end_event = torch.cuda.Event()
                job.end_event.record(self.stream)
                job.end_event.synchronize()     # the job's host buffers may be reused by the next job
        else:
            job.fn()
