"""``AsyncLLMEngine``: many coroutines stream from one engine loop — the ``EngineClient``
(``arbor.engine.client``) over a ``SteppedEngine`` (an ``LLMEngine``, or ``rank_front.RankFront``).

The loop is an asyncio task on the caller's event loop: it runs ``LLMEngine.step()`` while
work is queued (each step is synchronous, so weight updates and aborts always land between
steps), hands every request's fresh snapshot to its queue (a ``final_only`` request's final ones
only), and sleeps when idle. A stream
closed early (``aclose``, cancellation) aborts its request. A new event loop (another
``asyncio.run``) gets a new engine task; the engine state carries over.

Distributed expert-parallel engine (``LLMEngine.lockstep``): requests are streamed only inside
``async with engine.session():``, which every rank enters. Each loop iteration is one MAX
all-reduce of (this rank has work, this rank's session is open) on the control group, then one
step on every rank (idle where a rank has nothing) while any rank has work; the loop ends when no
rank has work and every session has closed. A rank waiting on its tools meanwhile keeps joining
the other ranks' forwards.
"""

from __future__ import annotations

import asyncio
import contextlib

from arbor.engine.client import SteppedEngine
from arbor.engine.config import EngineConfig
from arbor.engine.llm_engine import LLMEngine
from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion


class AsyncLLMEngine:
    def __init__(self, model_or_path, config: EngineConfig | None = None, tokenizer=None, ctx=None):
        """``model_or_path`` may also be a built ``SteppedEngine`` (an ``LLMEngine``, or
        ``rank_front.RankFront``), which is then streamed from as is."""
        if isinstance(model_or_path, SteppedEngine):
            self.engine = model_or_path
        else:
            self.engine = LLMEngine(model_or_path, config, tokenizer, ctx)
        self.queues: dict[str, asyncio.Queue] = {}
        self._loop = self._task = self._wake = None
        self._paused = False
        self._open = False

    @contextlib.asynccontextmanager
    async def session(self):
        """A window in which this engine serves streams. Collective under lockstep (every rank must
        enter and leave it; leaving waits until no rank has work); a no-op otherwise."""
        if not self.engine.lockstep:
            yield self
            return
        self._open = True
        self._ensure_loop()
        try:
            yield self
        finally:
            self._open = False
            self._wake.set()
            await self._task

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model(self):
        return self.engine.model

    @property
    def model_config(self):
        return self.engine.model.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_prompt_chars(self) -> int | None:
        """Texts longer than this are refused untokenized (``LLMEngine.max_prompt_chars``)."""
        return getattr(self.engine, "max_prompt_chars", None)

    def check_request(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ValueError when the engine would refuse it; changes nothing,
        so it may run on any thread (a long text is tokenized with the GIL released)."""
        return self.engine.check_request(prompt, params)

    def _ensure_loop(self) -> None:
        if self.engine.lockstep and not self._open:
            raise RuntimeError("a distributed engine streams only inside `async with engine.session():`, "
                               "entered by every rank")
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._run())
        self._wake.set()

    async def _run_lockstep(self) -> None:
        eng = self.engine
        while True:
            local = eng.has_unfinished() and not self._paused
            work, still_open = eng.ctx.flags_max(float(local), float(self._open), name="engine lockstep")
            if work:
                try:
                    updated = eng.step() if local else eng.idle_step() or []
                except Exception as e:
                    for q in self.queues.values():
                        q.put_nowait(e)
                    raise
                self._publish(updated)
                await asyncio.sleep(0)
            elif still_open:
                await asyncio.sleep(0.001)
            else:
                return

    @staticmethod
    def _withheld(seq) -> bool:
        """A snapshot a ``final_only`` request does not get (not its last). ``seq``: a Sequence, or a
        snapshot of another rank's (rank_front), which has no params."""
        return not seq.is_finished and getattr(getattr(seq, "params", None), "final_only", False)

    def _publish(self, updated) -> None:
        for seq in updated:
            if self._withheld(seq):
                continue
            q = self.queues.get(seq.request_id)
            if q is not None:  # text only on the final snapshot (decoding every step is O(n²))
                q.put_nowait(seq.completion(self.engine.tokenizer if seq.is_finished else None))

    async def _run(self) -> None:
        if self.engine.lockstep:
            return await self._run_lockstep()
        eng = self.engine
        while True:
            if self._paused or not eng.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                updated = eng.step()
            except Exception as e:  # fail every request rather than leave its stream waiting forever
                for rid in list(eng.requests):
                    if rid in self.queues:
                        self.queues[rid].put_nowait(e)
                    eng.abort(rid)
                await asyncio.sleep(0)
                continue
            self._publish(updated)
            await asyncio.sleep(0)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request now (raises ValueError on a bad one); read it with ``stream``."""
        rid = self.engine.add_request(prompt, params, request_id)
        self.queues[rid] = asyncio.Queue()
        return rid

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Async iterator of ``Completion`` snapshots (cumulative token ids / log-probs), one per
        new token of each sample (``.index``); ends when every sample has finished. ``text`` is
        set on each sample's final snapshot."""
        rid = self.add_request(prompt, params, request_id)
        async for out in self.stream(rid):
            yield out

    async def stream(self, rid: str):
        """The snapshots of a request queued by ``add_request``."""
        self._ensure_loop()
        q = self.queues[rid]
        live = self.engine.requests[rid][0].params.n
        try:
            while live:
                out = await q.get()
                if isinstance(out, Exception):
                    live = 0
                    raise out
                live -= out.finished
                yield out
        finally:
            self.queues.pop(rid, None)
            if live:
                self.engine.abort(rid)
            else:
                self.engine.requests.pop(rid, None)

    async def generate_all(self, prompt, params: SamplingParams | None = None) -> list[Completion]:
        """The final completions (one per sample) of one request."""
        last: dict[int, Completion] = {}
        async for out in self.generate(prompt, params):
            last[out.index] = out
        return [last[i] for i in sorted(last)]

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.queues.pop(request_id, None)

    def update_weights(self, named_tensors) -> float:
        return self.engine.update_weights(named_tensors)

    def stats(self) -> dict:
        """The engine's ``stats()`` plus the streams open here and whether stepping is paused."""
        return {**self.engine.stats(), "streams": len(self.queues), "paused": self._paused}

    async def run_between_steps(self, fn):
        """``fn()`` between two engine steps → its result (here: at once, on the loop, which steps
        only between its awaits)."""
        return fn()

    async def update_weights_between_steps(self, named_tensors) -> float:
        """``update_weights`` between two engine steps, awaited (the loop keeps serving) → seconds."""
        return await self.run_between_steps(lambda: self.engine.update_weights(named_tensors))

    def pause(self) -> None:
        """Stop stepping after the current step (requests stay queued)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self._wake is not None:
            self._wake.set()
