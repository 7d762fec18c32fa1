"""``RemoteEngine``: an ``EngineClient`` (``arbor.engine.client``) served by engine-replica actors.

The collector and the trainer use an engine through ``generate(prompt_ids, params)`` (an async
stream of cumulative ``Completion`` snapshots), ``session()`` and ``update_weights(state_dict)``;
this class offers those (with ``abort`` and ``stats``), so ``RLTrainer`` runs unchanged on Ray.

Load balancing: each request goes to the live replica with the fewest in-flight tokens of this
client (prompt + tokens already generated + tokens still allowed, per request until it ends). Each
trainer rank balances its own requests, so the sum over ranks stays balanced too. A client's
requests to one replica share one ``Channel`` (batched submission, one poll loop for the chunks of all).

Failures: when a replica's process dies mid-stream, the request is re-submitted at once to another
live replica from its token ids (prompt + the tokens received so far, ``max_tokens`` reduced by as
many, the seed advanced by as many, as the collector does when it resumes a C3PO++ turn), and the
manager replaces the dead replica in the background. The stream the collector sees goes on without
a gap: each token arrives exactly once, so no trajectory is lost or duplicated. The routed-expert
row of the last token before the break is −1 (it was prompt for the new replica): it routes itself.

Weights: every trainer rank calls ``update_weights`` once per sync (the loop does), which advances
its ``version``; requests carry that version and replicas hold them until they have it. Only the
publisher (trainer rank 0) moves weights: ``store`` puts one flat buffer into the object store and
the manager has every replica load it; ``broadcast`` sends it through a gloo group of rank 0 and the
replicas (rebuilt whenever a replica was replaced), retried up to ``BROADCAST_TRIES`` times. Under
expert parallelism every rank joins the gather of the experts first (collective). The publisher keeps
its last buffer (``kept``) as the source for replacements.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid

from arbor.cluster.channel import LOST, Channel
from arbor.cluster.weights import BroadcastGroup, flatten
from arbor.distributed import CollectiveError

BROADCAST_TRIES = 3


class ClusterError(CollectiveError):
    """The cluster cannot go on (a trainer rank died, replicas cannot be replaced); names what failed."""


class RemoteEngine:
    lockstep = False

    def __init__(self, manager, ctx=None, model=None, weight_sync: str = "store", timeout_s: float = 60.0,
                 publisher: bool | None = None):
        import ray
        self.manager, self.ctx, self.model = manager, ctx, model
        self.weight_sync, self.timeout_s = weight_sync, timeout_s
        self.publisher = (ctx is None or ctx.is_main) if publisher is None else publisher
        self.slots = [list(s) for s in ray.get(manager.table.remote())]     # [epoch, handle] per slot
        self.load = [0] * len(self.slots)
        self.down: dict[int, asyncio.Task | str] = {}     # slot → its replacement, or why it failed
        self.version = ray.get(manager.stats.remote())["version"]     # every rank reads it before any sync
        self.kept, self.group, self.group_key = None, None, None
        self.channels: dict[int, Channel] = {}
        self.resubmitted = 0
        self._ids = itertools.count()
        self._client = uuid.uuid4().hex[:8]

    @property
    def tokenizer(self):
        return None

    @contextlib.asynccontextmanager
    async def session(self):
        yield self

    # ---- rollouts ----------------------------------------------------------------------
    async def _pick(self) -> int:
        while True:
            live = [s for s in range(len(self.slots)) if s not in self.down]
            if live:
                return min(live, key=lambda s: (self.load[s], s))
            for s, t in list(self.down.items()):     # a replacement cut short by the end of an event loop
                if isinstance(t, asyncio.Future) and t.cancelled():
                    self.down[s] = asyncio.ensure_future(self._replace(s, self.slots[s][0]))
            waits = [t for t in self.down.values() if isinstance(t, asyncio.Future) and not t.done()]
            if not waits:
                raise ClusterError(f"every engine replica is down: {'; '.join(map(str, self.down.values()))}")
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

    def _lost(self, slot: int, epoch: int) -> None:
        """Replica ``slot`` of ``epoch`` died: route around it and have the manager replace it."""
        pending = self.down.get(slot)
        if self.slots[slot][0] != epoch or (isinstance(pending, asyncio.Future) and not pending.done()):
            return
        self.down[slot] = asyncio.ensure_future(self._replace(slot, epoch))

    async def _replace(self, slot: int, epoch: int) -> None:
        """Wait for the manager's replacement; on failure the slot stays down with the reason."""
        try:
            new_epoch, handle = await self.manager.replace.remote(slot, epoch)
        except Exception as e:                    # noqa: BLE001 (reported by _pick when no replica is left)
            self.down[slot] = f"replica {slot} could not be replaced: {first_line(getattr(e, 'cause', None) or e)}"
            return
        self.slots[slot] = [new_epoch, handle]
        self.down.pop(slot, None)

    def _channel(self, slot: int) -> Channel:
        """This event loop's channel to the replica now in ``slot``."""
        epoch, handle = self.slots[slot]
        ch = self.channels.get(slot)
        if ch is None or ch.epoch != epoch or ch.loop is not asyncio.get_running_loop():
            ch = self.channels[slot] = Channel(handle, self._client, epoch)
        return ch

    async def generate(self, prompt, params, request_id: str | None = None):
        """Async iterator of cumulative ``Completion`` snapshots of one sample (``params.n`` = 1)."""
        from arbor.engine.sequence import Completion
        if isinstance(prompt, str) or params.n != 1 or params.stop:
            raise ValueError("a remote engine takes token ids, n=1 and stop token ids (no stop strings)")
        prompt, rid = list(prompt), request_id or f"{self._client}-{next(self._ids)}"
        tokens, logprobs, routed, finish, part = [], [], None, None, 0
        while finish is None:
            slot = await self._pick()
            ch, start, sub = self._channel(slot), len(tokens), self._continuation(params, len(tokens))
            cost = len(prompt) + start + sub.max_tokens
            self.load[slot] += cost
            name = f"{rid}.{part}"
            q = ch.open(name, prompt + tokens, sub, self.version)
            try:
                while finish is None:
                    c = await q.get()
                    if c is LOST:
                        self._lost(slot, ch.epoch)
                        self.resubmitted += 1
                        part += 1
                        break
                    if c.error is not None:
                        raise c.error
                    tokens += c.token_ids
                    logprobs += c.logprobs
                    if c.routed_experts is not None:
                        routed = _join(routed, start + c.routed_from, c.routed_experts)
                    finish = c.finish_reason
                    yield Completion(rid, 0, prompt, list(tokens), list(logprobs), finish, routed_experts=routed)
            finally:
                self.load[slot] -= cost
                ch.close(name)                    # closed early (C3PO++ stop, cancellation): abort there

    @staticmethod
    def _continuation(params, done: int):
        """The same sampling for the rest of a sample after ``done`` tokens. Replicas always stream
        (``final_only`` off; their outbox batches the snapshots): the tokens received before a replica is
        lost are what a resubmission continues from."""
        import copy
        sub = copy.copy(params)
        sub.final_only = False
        sub.max_tokens = params.max_tokens - done
        if params.seed is not None and done:
            sub.seed = params.seed + done
        return sub

    def abort(self, request_id: str) -> None:
        """Streams end (and abort on their replica) when closed; nothing is queued here by id."""

    def stats(self) -> dict:
        """This client's view: replica slots, those down, in-flight tokens per slot, weight version,
        requests re-submitted after a replica died (no call to the replicas)."""
        return {"replicas": len(self.slots), "down": len(self.down), "load": list(self.load),
                "version": self.version, "resubmitted": self.resubmitted}

    # ---- weights -----------------------------------------------------------------------
    def update_weights(self, named_tensors) -> float:
        """One sync (every trainer rank calls it once per step). → seconds (the publisher's transfer)."""
        t0 = time.perf_counter()
        self.refresh()
        hf = self.ctx is not None and self.ctx.ep_size > 1
        if hf:
            from arbor.models.checkpoint import gather_hf_tensors
            named_tensors = gather_hf_tensors(self.model, self.ctx)
        self.version += 1
        if not self.publisher:
            return 0.0
        import ray
        flat, layout = flatten(named_tensors, hf_names=hf)
        self.kept = (self.version, flat, layout)
        try:
            if self.weight_sync == "store":
                ray.get(self.manager.push_store.remote(self.version, [ray.put(flat.numpy())], layout))
            else:
                self._broadcast(flat, layout)
        except ray.exceptions.RayError as e:      # e.g. a replica died and cannot be replaced
            cause = getattr(e, "cause", None) or e
            raise ClusterError(f"weight sync of version {self.version} failed: {first_line(cause)}") from e
        return time.perf_counter() - t0

    def refresh(self) -> None:
        """Take the manager's table: replicas replaced since (by any client or a sync) are live again."""
        import ray
        for slot, (epoch, handle) in enumerate(ray.get(self.manager.table.remote())):
            if epoch > self.slots[slot][0]:
                self.slots[slot] = [epoch, handle]
                self.down.pop(slot, None)

    def weights_ref(self):
        """(version, object ref, layout) of the last synced weights (a replacement's source)."""
        import ray
        version, flat, layout = self.kept
        return version, ray.put(flat.numpy()), layout

    def _broadcast(self, flat, layout) -> None:
        import ray
        for _ in range(BROADCAST_TRIES):
            key = tuple(e for e, _ in ray.get(self.manager.table.remote()))
            if key != self.group_key:
                self.group = BroadcastGroup.host(ray.util.get_node_ip_address(), len(key) + 1, self.timeout_s)
                self.group_key = key
            if not ray.get(self.manager.broadcast_begin.remote(self.version, layout, key, self.group.my_host,
                                                               self.group.port, self.timeout_s)):
                self.group_key = None
                continue
            try:
                self.group.broadcast(flat)
            except Exception:                     # noqa: BLE001 (a member died: rebuild and retry)
                self.group_key = None
            if ray.get(self.manager.broadcast_end.remote()):
                return
            self.group_key = None
        raise ClusterError(f"weight broadcast of version {self.version} failed {BROADCAST_TRIES} times")


def _join(routed, base: int, fresh):
    """The sample's routed rows below ``base`` (−1 where none came), then ``fresh``: [layers, tokens, k]."""
    import torch
    if routed is None:
        if base == 0:
            return fresh
        routed = fresh.new_full((fresh.shape[0], base, fresh.shape[2]), -1)
    return torch.cat([routed[:, :base], fresh], 1)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__

