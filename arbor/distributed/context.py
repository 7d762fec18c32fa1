"""The rank context: rank, world size, the process groups and the failure rules of a multi-rank run.

``init_distributed(cfg)`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``; ``arbor launch`` sets the same) and creates, in this order on every
rank: the default group (backend ``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on CUDA), a gloo ``control``
group for small messages, the expert-parallel groups (``ep_size`` consecutive ranks each) and the
expert-replica groups (ranks holding the same experts: ``world_size / ep_size`` of them), the P/D phase
groups (``phase_groups``) and, with ``fsdp``, a group of all ranks for FSDP2's collectives alone. Without
those variables, or with ``WORLD_SIZE=1``, it returns ``DistContext.single()``: no groups, and every
collective helper is the identity.

Failure rule — no hang, ever: every collective runs under ``ctx.guard(name)``, and the groups carry
``timeout_s``. When a peer dies (its sockets close) or a collective times out, the surviving rank
raises ``CollectiveError`` naming itself, the collective, and the peers it finds gone (same-host peers
are checked by pid); the CLI then exits at once (``os._exit``), without waiting on a broken group.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from arbor.kernels.allocator import tune_allocator


@dataclass
class DistConfig:
    """Multi-rank layout; only read when the job runs on several ranks (``arbor launch``, torchrun)."""
    ep_size: int = 0           # ranks that split each MoE layer's experts (0: all ranks for an MoE model, else 1)
    timeout_s: float = 60.0    # a collective that waits longer fails on every surviving rank
    phase_groups: bool = False # P/D multiplexing: prefill and decode get private expert-parallel groups
    fsdp: bool = False         # shard replicated parameters, gradients and AdamW moments over ranks (FSDP2; sft and train)

    def validate(self) -> None:
        if self.ep_size < 0:
            raise ValueError(f"ep_size must be ≥ 0 (0: all ranks), got {self.ep_size}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, timed out, or issued another collective. The message names
    this rank, the collective and the peers found gone."""


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ep_size: int = 1
    timeout_s: float = 60.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control: object = None          # gloo group for control messages
    ep_group: object = None         # this rank's expert-parallel group
    replica_group: object = None    # ranks holding the same experts as this one
    peers: list = field(default_factory=list)   # (host, pid) per rank
    phase_groups: dict = field(default_factory=dict)   # phase name → its private EP group (P/D multiplexing)
    queue: object = None            # a DeviceQueue every collective runs through (in-order, like a stream)
    fsdp_group: object = None       # dist.fsdp: all ranks, for FSDP2's all-gathers and reduce-scatters only

    def ep_group_for(self, phase: str):
        """The EP group a phase's exchanges use: its private one if it has one, else the shared one."""
        return self.phase_groups.get(phase, self.ep_group)

    def run(self, fn):
        """Run a collective: through the in-order device queue when there is one, else directly."""
        return self.queue.run(fn) if self.queue is not None else fn()

    @classmethod
    def single(cls) -> "DistContext":
        return cls()

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        """Replicated parameters are sharded over the ranks (``dist.fsdp``; ``arbor.train.fsdp``)."""
        return self.fsdp_group is not None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- failure handling -------------------------------------------------------------
    def gone_peers(self) -> list[int]:
        """Ranks on this host whose process has exited (a zombie not yet reaped counts as exited)."""
        host = socket.gethostname()
        return [r for r, (h, pid) in enumerate(self.peers) if r != self.rank and h == host and not process_alive(pid)]

    @contextlib.contextmanager
    def guard(self, name: str):
        """Re-raise any failure inside as ``CollectiveError`` naming rank, collective and dead peers."""
        try:
            yield
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as e:
            gone, text = self.gone_peers(), str(e)
            if gone:
                who = f"rank(s) {', '.join(map(str, gone))} exited"
            elif "reset by peer" in text or "closed by peer" in text or "Connection closed" in text:
                who = "a peer closed its connection (it exited or crashed on another host)"
            else:
                who = (f"no peer answered within {self.timeout_s:g} s (a rank may be stuck, dead on another "
                       "host, or issuing another collective)")
            raise CollectiveError(f"rank {self.rank}/{self.world_size}: collective '{name}' failed: {who}. "
                                  f"Cause: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e

    # ---- small collectives (identity on one rank) ---------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum", name: str = "all_reduce", group=None) -> torch.Tensor:
        if not self.distributed:
            return t
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        with self.guard(name):
            dist.all_reduce(t, ops[op], group=group)
        return t

    def flags_max(self, *values: float, name: str = "flags") -> list[float]:
        """Element-wise max of a few numbers over all ranks, on the control group."""
        t = torch.tensor(values, dtype=torch.float64)
        return self.all_reduce(t, "max", name, self.control).tolist()

    def sum_floats(self, values: list[float], name: str = "metrics") -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        return self.all_reduce(t, "sum", name, self.control).tolist()

    def all_gather_object(self, obj, name: str = "all_gather_object") -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        with self.guard(name):
            dist.all_gather_object(out, obj, group=self.control)
        return out

    def broadcast_object(self, obj, src: int = 0, name: str = "broadcast_object"):
        if not self.distributed:
            return obj
        box = [obj]
        with self.guard(name):
            dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    def barrier(self, name: str = "barrier") -> None:
        if self.distributed:
            with self.guard(name):
                dist.barrier(group=self.control)


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:             # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_ep_size(cfg: DistConfig, world_size: int, num_experts: int) -> int:
    """The EP degree for a model with ``num_experts`` experts (0 for dense) on ``world_size`` ranks."""
    ep = cfg.ep_size or (world_size if num_experts else 1)
    if ep < 1 or world_size % ep:
        raise ValueError(f"dist.ep_size={ep} does not divide the world size {world_size}; "
                         f"choose a divisor of {world_size} (or 0 for all ranks)")
    if ep > 1 and not num_experts:
        raise ValueError(f"dist.ep_size={ep} needs an MoE model; this one is dense (use dist.ep_size=1)")
    if ep > 1 and num_experts % ep:
        raise ValueError(f"dist.ep_size={ep} does not divide the {num_experts} experts of each MoE layer; "
                         f"choose an ep_size that divides {num_experts}")
    return ep


def init_distributed(cfg: DistConfig | None = None, num_experts: int = 0, device: str = "cpu") -> DistContext:
    """Join the run described by torchrun's environment (see module docstring); → the rank context."""
    cfg = cfg or DistConfig()
    tune_allocator()
    world = env_world_size()
    if cfg.fsdp and world <= 1:
        raise ValueError("dist.fsdp=true shards parameters over ranks and needs ≥ 2 ranks (arbor launch -n N …); "
                         "this run has 1 — launch it on several ranks or set dist.fsdp=false")
    if world <= 1:
        ctx = DistContext.single()
        ctx.ep_size = resolve_ep_size(cfg, 1, num_experts)
        return ctx
    if cfg.timeout_s <= 0:
        raise ValueError(f"dist.timeout_s must be > 0, got {cfg.timeout_s}")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: start ranks with "
                         "`arbor launch -n N ...` or torchrun")
    ep = resolve_ep_size(cfg, world, num_experts)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.timeout_s)
    ctx = DistContext(rank=rank, world_size=world, local_rank=local, ep_size=ep, timeout_s=cfg.timeout_s, device=dev)
    with ctx.guard("init_process_group"):
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        ctx.control = dist.new_group(backend="gloo", timeout=timeout)
        for start in range(0, world, ep):                 # every rank creates every group, in one order
            g = dist.new_group(list(range(start, start + ep)), timeout=timeout)
            if start <= rank < start + ep:
                ctx.ep_group = g
        for r in range(ep):
            g = dist.new_group(list(range(r, world, ep)), timeout=timeout)
            if rank % ep == r:
                ctx.replica_group = g
        if cfg.phase_groups:
            make_phase_groups(ctx)
        if cfg.fsdp:
            ctx.fsdp_group = dist.new_group(list(range(world)), timeout=timeout)
    ctx.peers = ctx.all_gather_object((socket.gethostname(), os.getpid()), "peer table")
    return ctx


def make_phase_groups(ctx: DistContext) -> None:
    """Give prefill and decode private expert-parallel groups (``ctx.phase_groups``), unless they have
    them. Collective over all ranks: every rank calls it at the same point (rank start, or the
    construction of a lockstep P/D engine)."""
    if not ctx.distributed or ctx.phase_groups:
        return
    timeout, ep = timedelta(seconds=ctx.timeout_s), ctx.ep_size
    with ctx.guard("phase groups"):
        for phase in ("prefill", "decode"):
            for start in range(0, ctx.world_size, ep):
                g = dist.new_group(list(range(start, start + ep)), timeout=timeout)
                if start <= ctx.rank < start + ep:
                    ctx.phase_groups[phase] = g


def leave(code: int = 0) -> None:
    """End a rank's process: meet the other ranks (so none is still using the group), flush, and exit
    without running destructors — tearing a gloo group down while a peer exits can abort the
    process in C++ ("terminate called without an active exception")."""
    import sys
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except Exception:        # a peer already gone: nothing left to wait for
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
