"""The sandboxed child process's side of `arbor.rollout.sandbox`: its limits (set in the forked child
before exec), its end (SIGKILL of its process group and, as root, of every process of its fresh uid;
its leftovers in the shared temporary folders in weak isolation), and its output (streams read
incrementally under a cap) and status."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import secrets
import shutil
import signal
import time

FRESH_UID_BASE = 1 << 20
_FILE_SIZE_BYTES = 16 << 20
_OPEN_FILES = 256
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
TRUNCATED = "\n[output truncated at {} bytes]"


def drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def child_setup(config, uid: int | None, nproc: int) -> None:
    """Runs in the forked child before exec. RLIMIT_AS goes last: the fork is a copy of a
    possibly large parent, and nothing may need to allocate after it is lowered."""
    cpu = config.cpu_s or math.ceil(config.timeout_s) + 1
    os.umask(0o077)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_BYTES, _FILE_SIZE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_OPEN_FILES, _OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if uid is not None:
        drop_to(uid)
    mem = config.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))


def fresh_uid() -> int | None:
    return FRESH_UID_BASE + secrets.randbelow(FRESH_UID_BASE) if os.geteuid() == 0 else None


def live_procs(uid: int) -> dict[int, int]:
    """{pid: number of tasks} of the non-zombie processes whose real uid is `uid`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            found[int(pid)] = int(fields["Threads"])
    return found


def kill_uid(uid: int) -> None:
    """SIGKILL every process of a run's fresh uid, including ones that left its process group."""
    for _ in range(50):
        pids = live_procs(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)


def remove_owned(uid: int) -> None:
    """Delete the entries of the shared temporary folders that belong to ``uid`` (a finished run's fresh uid)."""
    for folder in _SHARED_TMP:
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)


def killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def pump(stream: asyncio.StreamReader, cap: int, sink: bytearray, on_overflow) -> bool:
    """Append at most `cap` bytes of `stream` to `sink`; True (after on_overflow()) past it."""
    while chunk := await stream.read(1 << 16):
        room = cap - len(sink)
        sink += chunk[:room]
        if len(chunk) > room:
            on_overflow()
            return True
    return False


async def feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.write(data)
        await stream.drain()
        stream.close()


def decode(buf: bytearray, cap: int, pump: asyncio.Future) -> str:
    text = buf.decode("utf-8", errors="replace")
    overflowed = pump.done() and not pump.cancelled() and pump.exception() is None and pump.result()
    return text + TRUNCATED.format(cap) if overflowed else text


def exit_status(why: str | None, rc: int, stderr: str) -> str:
    if why:
        return why
    if rc == 0:
        return "ok"
    lines = stderr.strip().splitlines()
    if lines and lines[-1].startswith("MemoryError"):
        return "memory"
    if rc == -signal.SIGXCPU:
        return "timeout"
    return "killed" if rc < 0 else "error"


async def wait_exit(proc, until: float, stop: list) -> None:
    """Wait until `proc.returncode` is set, `stop` is non-empty, or `until` (not `await proc.wait()`, which
    also waits for the pipes that a leftover grandchild can hold open). The process's pidfd (Linux ≥ 5.3)
    wakes the wait when it exits; then, or without a pidfd, `proc.returncode` is polled (1 ms, doubling
    to 20 ms) until the child watcher has reaped it."""
    loop = asyncio.get_running_loop()
    exited, fd = loop.create_future(), None

    def on_exit() -> None:          # once: a pidfd stays readable, and would spin the loop
        loop.remove_reader(fd)
        if not exited.done():
            exited.set_result(None)
    if proc.returncode is None and hasattr(os, "pidfd_open"):
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(proc.pid)
            loop.add_reader(fd, on_exit)
    try:
        nap = 0.001
        while proc.returncode is None and not stop and time.monotonic() < until:
            if fd is not None and not exited.done():
                await asyncio.wait([exited], timeout=min(max(0.0, until - time.monotonic()), 0.05))
                continue        # at most 50 ms between looks at `stop`
            await asyncio.sleep(nap)
            nap = min(2 * nap, 0.02)
    finally:
        if fd is not None:
            loop.remove_reader(fd)
            os.close(fd)
