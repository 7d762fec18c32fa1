"""The replica manager: one async Ray actor that owns the engine replicas and their weights' version.

Slots 0..N-1 each hold one replica; a slot's ``epoch`` counts its replacements. Clients (each trainer
rank's ``RemoteEngine``) read the (epoch, handle) table and, when a call to a replica fails because
its process died, ask ``replace(slot, epoch)``: the first such call for an epoch kills the old actor
(freeing its bundle), starts a new one in the same placement-group bundle, loads it with the
current weights and bumps the epoch; later calls for that epoch get the new replica at once.

Invariants (an ``asyncio.Lock`` serialises replacements and syncs, so each holds on every path):
- ``version`` / the current weights are those of the last sync that reached every replica, or
  newer while a sync is in progress; a replacement is loaded with them before it enters the table,
  so every replica in the table holds the manager's ``version`` once a sync returns.
- Current weights for a replacement come from the object store (``store`` sync: the publisher's
  buffer, kept until the next sync), else from a live replica at ``version`` (its own copy), else from
  the registered trainer source (rank 0's kept buffer, ``broadcast`` sync).
- At most ``max_replacements`` replacements per run; past that ``replace`` raises.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass
class Bundle:
    """Where one actor runs: a placement-group bundle and the share of it that the actor requests."""
    pg: object
    index: int
    cpus: float
    gpus: float


def actor_options(b: Bundle) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return dict(num_cpus=b.cpus, num_gpus=b.gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(b.pg, placement_group_bundle_index=b.index))


def _dead(e: BaseException) -> bool:
    import ray.exceptions as rex
    return isinstance(e, rex.RayActorError)


class ReplicaManager:
    def __init__(self, spec, bundles: list[Bundle], max_replacements: int = 8, timeout_s: float = 120.0):
        self.spec, self.bundles, self.max_replacements, self.timeout_s = spec, bundles, max_replacements, timeout_s
        self.handles: list = [None] * len(bundles)
        self.epochs = [0] * len(bundles)
        self.version, self.current = 0, None      # current: (object ref, layout) of `version`
        self.source = None                        # actor with weights_ref() → (version, ref, layout)
        self.replacements, self.log = 0, []
        self._lock = asyncio.Lock()
        self._pending = None                      # a broadcast between begin and end: (version, refs)

    def _new(self, slot: int, epoch: int):
        import ray
        from arbor.cluster.replica import EngineReplica
        cls = ray.remote(EngineReplica)
        return cls.options(**actor_options(self.bundles[slot])).remote(self.spec, slot, epoch)

    async def start(self) -> list:
        self.handles = [self._new(s, 0) for s in range(len(self.bundles))]
        await asyncio.wait_for(asyncio.gather(*[h.info.remote() for h in self.handles]), self.timeout_s)
        return self.table()

    def table(self) -> list:
        """[(epoch, handle)] per slot."""
        return list(zip(self.epochs, self.handles))

    async def stats(self) -> dict:
        return {"version": self.version, "epochs": list(self.epochs), "replacements": self.replacements,
                "log": list(self.log)}

    async def set_source(self, actor) -> None:
        self.source = actor

    # ---- failures ----------------------------------------------------------------------
    async def replace(self, slot: int, epoch: int):
        """→ (epoch, handle) of slot ``slot`` after epoch ``epoch`` (a new replica the first time)."""
        async with self._lock:
            if self.epochs[slot] == epoch:
                await self._replace(slot)
            return self.epochs[slot], self.handles[slot]

    async def _replace(self, slot: int) -> None:
        import ray
        if self.replacements >= self.max_replacements:
            raise RuntimeError(f"engine replica {slot} died and the run already replaced "
                               f"{self.replacements} replicas (cluster.max_replacements)")
        t0 = time.perf_counter()
        old = self.handles[slot]
        ray.kill(old, no_restart=True)            # frees its bundle share; a no-op on a dead actor
        new = self._new(slot, self.epochs[slot] + 1)
        await asyncio.wait_for(new.info.remote(), self.timeout_s)
        await self._load_current(new, slot)
        self.handles[slot] = new
        self.epochs[slot] += 1
        self.replacements += 1
        self.log.append({"slot": slot, "epoch": self.epochs[slot], "version": self.version,
                         "seconds": time.perf_counter() - t0})

    async def _load_current(self, new, slot: int) -> None:
        if self.version == 0:
            return                                # the folder's weights
        if self.current is not None:
            ref, layout = self.current
            await new.load_weights.remote(self.version, ref, layout)
            return
        for s, h in enumerate(self.handles):
            if s == slot:
                continue
            try:
                version, ref, layout = await h.export_weights.remote()
            except Exception as e:                # noqa: BLE001 (a dead peer: try the next)
                if _dead(e):
                    continue
                raise
            if version == self.version:
                await new.load_weights.remote(version, ref, layout)
                return
        if self.source is None:
            raise RuntimeError(f"no copy of weights version {self.version} to load into replica {slot}")
        version, ref, layout = await self.source.weights_ref.remote()
        await new.load_weights.remote(version, ref, layout)

    # ---- weight sync -------------------------------------------------------------------
    async def push_store(self, version: int, box: list, layout) -> float:
        """Object-store sync: every replica loads ``box[0]`` (an object ref, boxed so that Ray passes it
        on instead of fetching it here); a dead one is replaced and loaded with it. → seconds."""
        t0 = time.perf_counter()
        ref = box[0]
        async with self._lock:
            self.version, self.current = version, (ref, layout)
            calls = [h.load_weights.remote(version, ref, layout) for h in self.handles]
            for slot, res in enumerate(await asyncio.gather(*calls, return_exceptions=True)):
                if isinstance(res, BaseException):
                    if not _dead(res):
                        raise res
                    await self._replace(slot)
        return time.perf_counter() - t0

    async def broadcast_begin(self, version: int, layout, key, master: str, port: int, timeout_s: float) -> bool:
        """Broadcast sync, first half: replace replicas found dead; then, when ``key`` (the epochs the
        publisher built its group for) is still the table's, start every replica's receive and hold the
        lock until ``broadcast_end``; False (nothing started) when the table changed: the publisher
        rebuilds its group."""
        await self._lock.acquire()
        try:
            alive = await asyncio.gather(*[h.info.remote() for h in self.handles], return_exceptions=True)
            for slot in [s for s, a in enumerate(alive) if isinstance(a, BaseException) and _dead(a)]:
                await self._replace(slot)         # died since the last sync: a gloo peer would hang till timeout
        except BaseException:
            self._lock.release()
            raise
        if tuple(self.epochs) != tuple(key):
            self._lock.release()
            return False
        size = len(self.handles) + 1
        self._pending = (version, [h.receive_broadcast.remote(version, layout, key, master, port, s + 1, size, timeout_s)
                                   for s, h in enumerate(self.handles)])
        return True

    async def broadcast_end(self) -> bool:
        """Second half: wait for the receives; a dead replica is replaced and loaded with the new
        version from a peer that got it (or the trainer source). → True when every replica holds it."""
        version, refs = self._pending
        self._pending = None
        try:
            results = await asyncio.gather(*refs, return_exceptions=True)
            got = [r == version for r in results]
            if any(got):
                self.version, self.current = version, None
            dead = [isinstance(r, BaseException) and _dead(r) for r in results]
            for slot in [s for s, d in enumerate(dead) if d]:
                await self._replace(slot)         # loaded from a peer that got `version`, or the source
            return any(got) and all(g or d for g, d in zip(got, dead))
        finally:
            self._lock.release()
