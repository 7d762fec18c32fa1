"""Weights on the wire: one flat byte buffer per sync, and a standalone gloo broadcast group.

``flatten(named)`` packs every tensor's raw bytes, in order (each at a 16-byte aligned offset; a
tensor that is another name's storage, such as a tied head, once), into one contiguous uint8 tensor and
returns ``Layout`` (name, dtype, shape, byte offset per tensor); ``unflatten`` views them back. The
round trip is bit-exact for every dtype (bfloat16 included): nothing is converted, only bytes move.
Both sync methods carry this buffer:

- ``store``: the publisher ``ray.put``s the buffer once; every replica reads it from the object store
  (zero-copy on the publisher's node, one transfer per other node).
- ``broadcast``: ``BroadcastGroup``, a gloo process group of its own (rank 0 the publisher, ranks
  1..N the replicas) built on a ``TCPStore``, outside torch.distributed's default world (which the
  trainer ranks use among themselves), so it can be rebuilt whenever a replica is replaced.

torch is imported inside the functions: the replica manager passes ``Layout``s on without loading it.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from datetime import timedelta


ALIGN = 16      # bytes


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str          # e.g. "float32"
    shape: tuple
    offset: int         # bytes from the buffer's start
    nbytes: int


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    total: int          # bytes
    hf_names: bool = False    # names are HF checkpoint names (gathered experts), not module names


def flatten(named, hf_names: bool = False):
    """→ (uint8 CPU tensor holding every tensor's bytes, its ``Layout``)."""
    import torch
    parts, entries, off, seen = [], [], 0, {}
    for name, t in named.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)
        if key in seen:                      # a tied weight (embedding = head) travels once
            entries.append(Entry(name, *seen[key]))
            continue
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        pad = -off % ALIGN                   # every tensor starts aligned for its dtype's view
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
            off += pad
        seen[key] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), off, raw.numel())
        entries.append(Entry(name, *seen[key]))
        parts.append(raw)
        off += raw.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat, Layout(tuple(entries), off, hf_names)


def as_tensor(buffer):
    """A uint8 tensor over ``buffer`` (a tensor, or a read-only numpy array from the object store),
    without copying; it is only read."""
    import torch
    if isinstance(buffer, torch.Tensor):
        return buffer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # read-only: never written
        return torch.from_numpy(buffer)


def unflatten(flat, layout: Layout) -> dict:
    """Views of the uint8 tensor ``flat`` named as in ``layout`` (no copy)."""
    import torch
    if flat.numel() != layout.total:
        raise ValueError(f"weight buffer holds {flat.numel()} bytes, its layout {layout.total}")
    return {e.name: flat[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
            for e in layout.entries}


def digests(named) -> dict[str, str]:
    """sha256 of every tensor's bytes: equal digests ⇔ bit-identical tensors (same dtype and shape)."""
    import torch
    out = {}
    for name, t in named.items():
        t = t.detach().to("cpu").contiguous()
        out[name] = f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return out


class BroadcastGroup:
    """A gloo group of ``size`` processes for one-to-all broadcasts from rank 0.

    Rank 0 creates it with ``BroadcastGroup.host(my_host, size, timeout_s)`` (its store listens on a
    free port, ``.port``) and the others with ``BroadcastGroup.join(...)``; the gloo rendezvous
    (``connect``) blocks until all ``size`` have joined or ``timeout_s`` passes. A member that dies
    breaks the group: every later call raises, and the group is replaced, never repaired."""

    def __init__(self, store, rank: int, size: int, my_host: str, timeout_s: float):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timedelta(seconds=timeout_s)
        self.my_host, self.pg = my_host, None

    @classmethod
    def host(cls, my_host: str, size: int, timeout_s: float) -> "BroadcastGroup":
        import torch.distributed as dist
        store = dist.TCPStore(my_host, 0, size, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        return cls(store, 0, size, my_host, timeout_s)

    @classmethod
    def join(cls, master: str, port: int, rank: int, size: int, my_host: str, timeout_s: float) -> "BroadcastGroup":
        import torch.distributed as dist
        store = dist.TCPStore(master, port, size, False, timedelta(seconds=timeout_s))
        return cls(store, rank, size, my_host, timeout_s)

    @property
    def port(self) -> int:
        return self.store.port

    def connect(self) -> None:
        import torch.distributed as dist
        if self.pg is None:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.my_host)]
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.size, opts)

    def broadcast(self, flat) -> None:
        """Rank 0's uint8 tensor ``flat`` into every member's ``flat`` (same size)."""
        import torch.distributed as dist
        self.connect()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()
