"""An engine replica: one ``AsyncLLMEngine`` in a Ray actor, streaming to remote clients.

Created by the ``ReplicaManager`` (``ray.remote(EngineReplica)``, an async actor): it loads the
model folder in the engine's dtype, so a fresh replica serves the run's initial weights (version 0)
until it is given newer ones.

Invariants:
- ``version`` is the number of weight updates applied (the trainer's sync count). A request carries
  the version its client has synced to (``min_version``) and waits until the replica holds at least
  that one, so no token is sampled from weights older than the client's.
- Weights change only between engine steps (``update_weights`` runs on the actor's event loop, which
  steps the engine between its awaits), and only forward (an older version is ignored).
- ``generate`` streams ``Chunk``s: the tokens and log-probs new since the last chunk, and the
  routed-expert rows from the one before them on (the engine fills a token's row only once it has
  been fed back, so the previous last row is re-sent). Engine snapshots closer than
  ``stream_interval_s`` to the previous chunk are folded into the next one (each Ray object costs
  about a millisecond of CPU on both sides); the final snapshot is always sent at once. A closed or
  cancelled stream aborts its request.

torch is imported by the actor's methods only, so the manager can name this class without loading it.
"""

from __future__ import annotations

import asyncio
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
    stream_interval_s: float = 0.05     # least time between two chunks of one stream (but the last)


@dataclass
class Chunk:
    token_ids: list[int]                # new since the previous chunk
    logprobs: list[float]
    finish_reason: str | None
    routed_from: int                    # routed_experts rows below replace the client's from this index on
    routed_experts: object | None       # torch.Tensor [layers, rows, k]
    version: int                        # weights that sampled these tokens


class EngineReplica:
    def __init__(self, spec: ReplicaSpec, slot: int, epoch: int):
        import torch

        from arbor.engine import AsyncLLMEngine, EngineConfig
        torch.set_num_threads(max(1, spec.threads))
        self.slot, self.epoch, self.interval = slot, epoch, spec.stream_interval_s
        self.engine = AsyncLLMEngine(spec.model, EngineConfig(**spec.engine))
        self.version = 0
        self._updated: asyncio.Event | None = None
        self.group, self.group_key = None, None

    def _event(self) -> asyncio.Event:
        if self._updated is None:
            self._updated = asyncio.Event()
        return self._updated

    async def info(self) -> dict:
        import ray
        return {"slot": self.slot, "epoch": self.epoch, "pid": os.getpid(), "version": self.version,
                "node": ray.util.get_node_ip_address(), "running": len(self.engine.engine.requests)}

    # ---- rollouts ----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params, min_version: int, request_id: str):
        while self.version < min_version:
            await self._event().wait()
        stream = self.engine.generate(prompt_ids, params, request_id)
        sent, last = 0, time.monotonic()
        try:
            async for out in stream:
                if out.finish_reason is None and time.monotonic() - last < self.interval:
                    continue                  # snapshots are cumulative: the next chunk carries these tokens
                n, r = len(out.token_ids), out.routed_experts
                frm = max(0, sent - 1)
                yield Chunk(out.token_ids[sent:], out.logprobs[sent:n], out.finish_reason, frm,
                            None if r is None else r[:, frm:n].clone(), self.version)
                sent, last = n, time.monotonic()
        finally:
            await stream.aclose()

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
