"""``Channel``: one client's link to one engine replica, carrying all of its requests there.

A ``RemoteEngine`` keeps one channel per live replica (per event loop). ``open`` queues a request
and returns the queue its ``Chunk``s arrive on; ``close`` aborts a request still running. Requests
opened (and closed) in one turn of the event loop travel in one ``submit`` call, and one ``poll``
loop collects the chunks of every request in flight there, so a step's rollout costs a replica a
few calls per engine-step interval instead of one call and one stream per sample.

Invariants:
- At most one ``submit`` is in flight per channel, so a request's abort never overtakes its submission.
- The poll loop runs while a request is in flight; its calls carry a rising ``seq`` (see
  ``replica.EngineReplica.poll``), so a call left behind by a finished event loop takes nothing.
- When the replica dies (a ``RayActorError`` from either call), every open request's queue receives
  ``LOST`` once and the channel stays dead; requests opened later on it get ``LOST`` at once.
"""

from __future__ import annotations

import asyncio
import itertools

LOST = "lost"                             # the replica died: re-submit from the tokens received


class Channel:
    _seq = itertools.count()             # poll sequence numbers, rising across channels and loops

    def __init__(self, handle, client: str, epoch: int):
        self.handle, self.client, self.epoch = handle, client, epoch
        self.loop = asyncio.get_running_loop()
        self.queues: dict[str, asyncio.Queue] = {}
        self.pending, self.aborts = [], []
        self.sender = self.poller = None
        self.dead = False

    def open(self, rid: str, prompt: list[int], params, min_version: int) -> asyncio.Queue:
        q = asyncio.Queue()
        if self.dead:
            q.put_nowait(LOST)
            return q
        self.queues[rid] = q
        self.pending.append((rid, prompt, params, min_version))
        self._wake()
        return q

    def close(self, rid: str) -> None:
        """Abort ``rid`` if it is still running (a no-op once it finished or was lost)."""
        if self.queues.pop(rid, None) is None:
            return
        n = len(self.pending)
        self.pending = [r for r in self.pending if r[0] != rid]
        if len(self.pending) == n:        # already submitted: abort it there
            self.aborts.append(rid)
            self._wake()

    def _wake(self) -> None:
        if self.sender is None or self.sender.done():
            self.sender = self.loop.create_task(self._send())
        if self.queues and (self.poller is None or self.poller.done()):
            self.poller = self.loop.create_task(self._poll())

    async def _send(self) -> None:
        import ray.exceptions as rex
        await asyncio.sleep(0)            # let the other requests of this turn join the batch
        while (self.pending or self.aborts) and not self.dead:
            batch, aborts, self.pending, self.aborts = self.pending, self.aborts, [], []
            try:
                await self.handle.submit.remote(self.client, batch, aborts)
            except rex.RayActorError:
                self._die()

    async def _poll(self) -> None:
        import ray.exceptions as rex
        try:
            while self.queues and not self.dead:
                for c in await self.handle.poll.remote(self.client, next(self._seq)):
                    q = self.queues.get(c.request_id)
                    if q is None:         # closed meanwhile
                        continue
                    if c.finish_reason is not None:
                        del self.queues[c.request_id]
                    q.put_nowait(c)
        except rex.RayActorError:
            self._die()

    def _die(self) -> None:
        self.dead = True
        for q in self.queues.values():
            q.put_nowait(LOST)
        self.queues.clear()
        self.pending, self.aborts = [], []
