"""``ThreadedAsyncLLMEngine``: the server's ``AsyncLLMEngine``, whose engine steps run on a thread of their own.

A step of ``AsyncLLMEngine`` runs on the event loop, which then answers nothing (not even
``/health``) until the step ends. Here the loop never touches the engine after construction:

- ``add_request`` / ``abort`` append a command to a queue and return; ``run_between_steps(fn)`` runs
  ``fn`` as a job of the engine thread, hence between two steps;
- one daemon thread (the engine thread) takes the commands in arrival order, applies them, then
  runs one ``LLMEngine.step()`` when there is work, and hands back a ``Completion`` snapshot per
  sequence that got a token (built on that thread, so the loop never reads a mutating ``Sequence``);
- the loop's driver task submits that job whenever commands are queued or the engine has work, and
  publishes the snapshots to the requests' queues.

Invariants: only the engine thread reads or writes the engine's request tables, scheduler, KV and
weights; an abort queued before a step is applied before that step, so a dropped client's sequences
leave the running set within one step of the abort; a request whose samples have all finished, or
that was aborted, is gone from ``engine.requests`` when its last snapshot reaches the loop; an
aborted request whose stream is still read gets a final snapshot per unfinished sample with
``finish_reason == "abort"``. Lockstep (distributed) engines are not supported: their collectives
must stay on the loop's schedule, so they use ``AsyncLLMEngine``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
from itertools import count
from typing import NamedTuple

from arbor.engine.async_engine import AsyncLLMEngine
from arbor.engine.sampling_params import SamplingParams


class EngineThread:
    """One daemon thread running submitted callables in order (a daemon, so that a forced exit of
    the process never waits for a step). Also the diffusion server's decode worker."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="arbor-engine", daemon=True).start()

    def submit(self, fn) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        self.jobs.put((fut, fn))
        return fut

    def _loop(self) -> None:
        while True:
            fut, fn = self.jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the awaiting coroutine
                    fut.set_exception(e)


class _Failed(NamedTuple):
    request_id: str
    error: Exception


class ThreadedAsyncLLMEngine(AsyncLLMEngine):
    """``AsyncLLMEngine`` whose steps run on the engine thread; see the module docstring. Call its
    methods from the event loop's thread."""

    def __init__(self, model_or_path, config=None, tokenizer=None, ctx=None):
        super().__init__(model_or_path, config, tokenizer, ctx)
        if self.engine.lockstep:
            raise ValueError("a distributed (lockstep) engine steps on the event loop; use AsyncLLMEngine")
        self._commands: collections.deque = collections.deque()
        self._samples: dict[str, int] = {}       # live request id → n (the loop's view)
        self._busy = False                       # the engine had unfinished work after the last job
        self._thread = EngineThread()
        self._rids = count()
        self._stats = self.engine.stats()        # the engine's, as of the engine thread's last job

    # ---- the loop's side ---------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate now (ValueError on a bad request; a long text is tokenized here, so call this
        off the loop for one) and queue the add for the engine thread."""
        params = params or SamplingParams()
        ids = self.engine.check_request(prompt, params)
        rid = request_id or f"req-{next(self._rids)}"
        if rid in self._samples:
            raise ValueError(f"request id '{rid}' is already in use")
        self._samples[rid] = params.n
        self.queues[rid] = asyncio.Queue()
        self._command(("add", rid, ids, params))
        return rid

    def abort(self, request_id: str) -> None:
        """Drop the request (idempotent); its stream gets nothing more."""
        self.queues.pop(request_id, None)
        if self._samples.pop(request_id, None) is not None:
            self._command(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request; streams still being read end with ``finish_reason == "abort"``."""
        for rid in list(self._samples):
            self._command(("abort", rid))

    async def run_between_steps(self, fn):
        """``fn()`` on the engine thread, between two steps (e.g. a weight update) → its result."""
        return await asyncio.wrap_future(self._thread.submit(fn))

    def update_weights(self, named_tensors) -> float:
        """Blocking form of ``run_between_steps(engine.update_weights)``."""
        return self._thread.submit(lambda: self.engine.update_weights(named_tensors)).result()

    def num_requests(self) -> int:
        return len(self._samples)

    def stats(self) -> dict:
        """The engine's ``stats()`` as of the end of the engine thread's last job (read there, so the
        loop never reads a mutating engine), plus this front's live requests and queued commands."""
        return {**self._stats, "streams": len(self._samples), "commands_queued": len(self._commands),
                "paused": self._paused}

    def _command(self, cmd) -> None:
        self._commands.append(cmd)
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self._commands and (self._paused or not self._busy):
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outs, self._busy = await asyncio.wrap_future(self._thread.submit(self._work))
            except Exception as e:  # a failed step: fail every request rather than leave it waiting
                for rid in list(self._samples):
                    q = self.queues.get(rid)
                    if q is not None:
                        q.put_nowait(e)
                    self.abort(rid)
                self._busy = True           # let the aborts be applied
                continue
            for out in outs:
                q = self.queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out.error if isinstance(out, _Failed) else out)

    async def stream(self, rid: str):
        """The snapshots of a request queued by ``add_request``; leaving early aborts it."""
        self._ensure_loop()
        q, live = self.queues[rid], self._samples[rid]
        try:
            while live:
                out = await q.get()
                if isinstance(out, Exception):
                    raise out
                live -= out.finished
                yield out
        finally:
            if live:
                self.abort(rid)
            else:
                self.queues.pop(rid, None)
                self._samples.pop(rid, None)

    # ---- the engine thread's side ------------------------------------------------------
    def _work(self):
        """Apply the queued commands, then one step if there is work → (snapshots, work left)."""
        eng, tok, outs = self.engine, self.engine.tokenizer, []
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                try:
                    eng.add_request(cmd[2], cmd[3], cmd[1])
                except ValueError as e:         # checked on arrival, so only if the engine changed since
                    outs.append(_Failed(cmd[1], e))
            else:
                live = [s for s in eng.requests.get(cmd[1], ()) if not s.is_finished]
                eng.abort(cmd[1])
                outs += [s.completion(tok) for s in live]
        if not self._paused and eng.has_unfinished():
            for seq in eng.step():
                if self._withheld(seq):
                    continue
                outs.append(seq.completion(tok if seq.is_finished else None))
                if seq.is_finished and all(s.is_finished for s in eng.requests.get(seq.request_id, ())):
                    eng.requests.pop(seq.request_id, None)
        self._stats = eng.stats()
        return outs, eng.has_unfinished()
