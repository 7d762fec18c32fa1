"""An engine replica: one ``AsyncLLMEngine`` in a Ray actor, serving its clients in batches.

Created by the ``ReplicaManager`` (``ray.remote(EngineReplica)``, an async actor): it loads the
model folder in the engine's dtype, so a fresh replica serves the run's initial weights (version 0)
until it is given newer ones.

Each client (one ``RemoteEngine``, i.e. one trainer rank) talks to a replica through two calls,
whatever the number of requests in flight (every Ray call costs CPU time on both sides, so the calls
per engine step must not grow with the number of requests):
- ``submit(client, requests, aborts)`` queues many requests at once and aborts others;
- ``poll(client, seq)`` answers, for every request of that client with something new, one ``Chunk``:
  the tokens and log-probs new since the last answer, and the routed-expert rows from the one before
  them on (the engine fills a token's row only once it has been fed back, so the previous last row is
  re-sent). An answer waits until a request has finished (or failed), or until ``stream_interval_s``
  after the previous answer when only unfinished requests have news, or at most ``POLL_WAIT_S``.

Invariants:
- Each token reaches its client exactly once: a chunk is cut from the request's latest snapshot and
  the count already sent, both only on the actor's event loop.
- Only the newest poll of a client (the highest ``seq``) takes chunks; an older one still waiting
  (its caller gave up, e.g. at the end of an event loop) answers ``[]``, so nothing is lost to it.
- ``version`` is the number of weight updates applied (the trainer's sync count). A request carries
  the version its client has synced to (``min_version``) and waits until the replica holds at least
  that one, so no token is sampled from weights older than the client's.
- Weights change only between engine steps (``update_weights`` runs on the actor's event loop, which
  steps the engine between its awaits), and only forward (an older version is ignored).

torch is imported by the actor's methods only, so the manager can name this class without loading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field

from arbor.cluster.weights import BroadcastGroup, Layout, as_tensor, digests, flatten, unflatten


@dataclass
class ReplicaSpec:
    """What every replica is built from."""
    model: str                          # HF folder
    engine: dict = field(default_factory=dict)     # EngineConfig keywords
    threads: int = 1                    # torch intra-op threads
    stream_interval_s: float = 0.05     # least time between two answers of a client's polls (but on a finish)


POLL_WAIT_S = 1.0                       # a poll with nothing to say answers [] after this long


@dataclass
class Chunk:
    request_id: str
    token_ids: list[int]                # new since the previous chunk of this request
    logprobs: list[float]
    finish_reason: str | None
    routed_from: int                    # routed_experts rows below replace the client's from this index on
    routed_experts: object | None       # torch.Tensor [layers, rows, k]
    error: BaseException | None = None  # the request failed on the replica (the client raises it)


class Outbox:
    """One client's news: the latest snapshot (or error) of each request that changed since the last
    answer, and how many tokens of each request were sent."""

    def __init__(self):
        self.latest: dict[str, object] = {}
        self.sent: dict[str, int] = {}
        self.urgent = False               # a request in ``latest`` finished or failed
        self.news = asyncio.Event()
        self.seq, self.answered = -1, 0.0

    def put(self, rid: str, out) -> None:
        first = rid not in self.latest
        self.latest[rid] = out
        if isinstance(out, BaseException) or out.finish_reason is not None:
            self.urgent = first = True
        if first:                         # a waiting poll re-checks only when its answer may change
            self.news.set()

    def drop(self, rid: str) -> None:
        self.latest.pop(rid, None)
        self.sent.pop(rid, None)
        self.urgent = self.urgent and any(isinstance(o, BaseException) or o.finish_reason for o in self.latest.values())

    def take(self) -> list[Chunk]:
        chunks = []
        for rid, out in self.latest.items():
            if isinstance(out, BaseException):
                chunks.append(Chunk(rid, [], [], "error", 0, None, out))
                self.sent.pop(rid, None)
                continue
            sent, n, r = self.sent.get(rid, 0), len(out.token_ids), out.routed_experts
            frm = max(0, sent - 1)
            chunks.append(Chunk(rid, out.token_ids[sent:], out.logprobs[sent:n], out.finish_reason, frm,
                                None if r is None else r[:, frm:n].clone()))
            if out.finish_reason is None:
                self.sent[rid] = n
            else:
                self.sent.pop(rid, None)
        self.latest.clear()
        self.urgent = False
        self.answered = time.monotonic()
        return chunks


class StepMeter:
    """Wraps an engine's ``step``: steps taken, their wall seconds and the CPU seconds of the thread that
    ran them. CPU ÷ wall is the share of a core the replica had while stepping (below 1: it waited for
    one, e.g. more busy processes than cores)."""

    def __init__(self, step):
        self.step, self.steps, self.wall_s, self.cpu_s = step, 0, 0.0, 0.0

    def __call__(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.step()
        finally:
            self.steps += 1
            self.wall_s += time.perf_counter() - t0
            self.cpu_s += time.thread_time() - c0

    def stats(self) -> dict:
        return {"steps": self.steps, "step_s": self.wall_s, "step_cpu_s": self.cpu_s}


class EngineReplica:
    def __init__(self, spec: ReplicaSpec, slot: int, epoch: int):
        import torch

        from arbor.engine import AsyncLLMEngine, EngineConfig
        torch.set_num_threads(max(1, spec.threads))
        self.slot, self.epoch, self.interval = slot, epoch, spec.stream_interval_s
        self.engine = AsyncLLMEngine(spec.model, EngineConfig(**spec.engine))
        self.meter = self.engine.engine.step = StepMeter(self.engine.engine.step)   # the engine loop steps through it
        self.version = 0
        self._updated: asyncio.Event | None = None
        self.group, self.group_key = None, None
        self.boxes: dict[str, Outbox] = {}
        self.tasks: dict[str, asyncio.Task] = {}       # request id → the task streaming it
        self.calls = {"submit": 0, "poll": 0, "requests": 0}

    def _event(self) -> asyncio.Event:
        if self._updated is None:
            self._updated = asyncio.Event()
        return self._updated

    async def info(self) -> dict:
        import ray
        return {"slot": self.slot, "epoch": self.epoch, "pid": os.getpid(), "version": self.version,
                "node": ray.util.get_node_ip_address(), "running": len(self.engine.engine.requests),
                "calls": dict(self.calls), **self.meter.stats()}

    # ---- rollouts ----------------------------------------------------------------------
    async def submit(self, client: str, requests: list, aborts: list[str]) -> None:
        """Start ``requests`` [(request id, prompt ids, SamplingParams with n = 1, min_version)], then
        abort ``aborts`` (request ids of this client; their news is dropped)."""
        self.calls["submit"] += 1
        self.calls["requests"] += len(requests)
        box = self.boxes.setdefault(client, Outbox())
        for rid, prompt, params, min_version in requests:
            self.tasks[rid] = asyncio.ensure_future(self._serve(box, rid, prompt, params, min_version))
        for rid in aborts:
            task = self.tasks.pop(rid, None)
            if task is not None:
                task.cancel()
            box.drop(rid)

    async def _serve(self, box: Outbox, rid: str, prompt, params, min_version: int) -> None:
        stream = None
        try:
            while self.version < min_version:
                await self._event().wait()
            stream = self.engine.generate(prompt, params, rid)
            async for out in stream:      # cumulative snapshots: the latest one carries all before it
                box.put(rid, out)
        except Exception as e:            # noqa: BLE001 (a bad request or an engine failure: the client raises it)
            box.put(rid, e)
        finally:
            if stream is not None:
                await stream.aclose()     # aborts the request when cancelled mid-stream
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]

    async def poll(self, client: str, seq: int) -> list[Chunk]:
        """The news of ``client``'s requests (see the module's docstring for when it answers)."""
        self.calls["poll"] += 1
        box = self.boxes.setdefault(client, Outbox())
        box.seq = max(box.seq, seq)
        box.news.set()                    # an older poll still waiting answers [] now
        t0 = time.monotonic()
        while True:
            if seq != box.seq:
                return []
            now = time.monotonic()
            due = box.answered + self.interval
            if (box.latest and (box.urgent or now >= due)) or now - t0 >= POLL_WAIT_S:
                return box.take()
            wait = t0 + POLL_WAIT_S - now
            if box.latest:
                wait = min(wait, due - now)
            box.news.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(box.news.wait(), wait)

    # ---- weights -----------------------------------------------------------------------
    def _apply(self, version: int, flat, layout: Layout) -> int:
        if version < self.version:
            return self.version
        tensors = unflatten(flat, layout)
        if layout.hf_names:           # gathered experts of an expert-parallel trainer
            from arbor.models.checkpoint import from_hf_tensors
            tensors = from_hf_tensors(tensors, self.engine.engine.model)
        self.engine.update_weights(tensors)
        self.version = version
        self._event().set()
        self._updated = None          # waiters hold the set event; later ones get a fresh one
        return version

    async def load_weights(self, version: int, buffer, layout: Layout) -> int:
        """Object-store sync: ``buffer`` arrives resolved (numpy, zero-copy on this node). → version held."""
        return self._apply(version, as_tensor(buffer), layout)

    async def receive_broadcast(self, version: int, layout: Layout, key, master: str, port: int, rank: int,
                                size: int, timeout_s: float) -> int:
        """Broadcast sync: join group ``key`` (once) as ``rank`` of ``size`` and receive the buffer."""
        import ray
        import torch
        if self.group_key != key:
            self.group = BroadcastGroup.join(master, port, rank, size, ray.util.get_node_ip_address(), timeout_s)
            self.group_key = key
        flat = torch.empty(layout.total, dtype=torch.uint8)
        try:
            await asyncio.to_thread(self.group.broadcast, flat)      # the engine may step meanwhile
        except Exception:
            self.group, self.group_key = None, None
            raise
        return self._apply(version, flat, layout)

    async def export_weights(self):
        """(version, object ref of the flat buffer, layout) of the weights this replica serves:
        the source for a replacement replica when no trainer copy is at hand."""
        import ray
        flat, layout = flatten(self.engine.engine.model.state_dict())
        return self.version, ray.put(flat.numpy()), layout

    async def digests(self) -> dict[str, str]:
        return digests(self.engine.engine.model.state_dict())
