"""Start N local ranks of one command, torchrun-style, and watch them.

Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``) and ``threads`` intra-op
threads (``OMP_NUM_THREADS``). Its stdout and stderr are streamed line by line with a ``[rank k]``
prefix. When a rank exits non-zero the others get ``grace_s`` to exit by themselves (their
collectives fail at once when a peer's sockets close) and are then terminated; the launch returns
the first failing rank's exit code (128 + signal for a killed rank). ``timeout_s`` bounds the whole
run: past it every rank is killed and the code is 124.

Signals: the first SIGTERM or SIGINT (Ctrl-C) to the launcher is forwarded to every rank as SIGTERM
and the ranks get ``grace_s`` to exit by themselves; a second one, or the end of the grace, kills
them. The ranks run in their own sessions (a terminal's Ctrl-C reaches only the launcher) and find
the launcher's pid in ``ARBOR_LAUNCHER_PID``, so a long-running rank can notice that it was
orphaned.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchResult:
    returncode: int                      # 0, the first failing rank's code, or 124 on timeout
    codes: list[int | None]              # each rank's exit code (None: killed by the launcher)
    failed_rank: int | None = None
    output: list[list[str]] = field(default_factory=list)   # each rank's lines (stdout and stderr)

    def text(self, rank: int) -> str:
        return "\n".join(self.output[rank])


def _pump(stream, rank: int, lines: list[str], echo, lock) -> None:
    for raw in iter(stream.readline, ""):
        line = raw.rstrip("\n")
        lines.append(line)
        if echo is not None:
            with lock:
                print(f"[rank {rank}] {line}", file=echo, flush=True)
    stream.close()


def _code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def launch(argv: list[str], nprocs: int, threads: int | None = None, timeout_s: float | None = None,
           grace_s: float = 5.0, env: dict | None = None, echo=sys.stdout) -> LaunchResult:
    """Run ``argv`` as ``nprocs`` ranks (see module docstring); ``echo=None`` keeps output quiet."""
    if nprocs < 1:
        raise ValueError(f"the number of ranks must be ≥ 1, got {nprocs}")
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    base = {**os.environ, **(env or {}), "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1", "ARBOR_LAUNCHER_PID": str(os.getpid())}
    procs, outputs, pumps, lock = [], [], [], threading.Lock()
    for r in range(nprocs):
        p = subprocess.Popen(argv, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        procs.append(p)
        outputs.append([])
        t = threading.Thread(target=_pump, args=(p.stdout, r, outputs[-1], echo, lock), daemon=True)
        t.start()
        pumps.append(t)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed, stop_at, returncode, signalled = None, None, 0, []

    def on_signal(signum, frame):
        nonlocal stop_at
        signalled.append(signum)
        if len(signalled) > 1:
            stop_at = 0.0
            return
        stop_at = time.monotonic() + grace_s
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)

    handled = (signal.SIGTERM, signal.SIGINT)
    old = ({s: signal.signal(s, on_signal) for s in handled}
           if threading.current_thread() is threading.main_thread() else {})
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed is None:
                failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if failed is not None:
                    stop_at = now + grace_s
            if (stop_at is not None and now > stop_at) or (deadline is not None and now > deadline):
                if failed is None:
                    returncode = 124
                break
            time.sleep(0.02)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=2)
    codes = [p.returncode for p in procs]
    if failed is None and returncode == 0:
        failed = next((r for r, c in enumerate(codes) if c != 0), None)
    if failed is not None:
        returncode = _code(codes[failed])
    elif signalled and returncode == 0 and any(codes):
        returncode = 128 + signalled[0]
    if echo is not None and returncode:
        why = "timed out" if returncode == 124 and failed is None else f"rank {failed} exited with code {returncode}"
        print(f"arbor launch: {why}; stopped the other ranks (exit codes {codes})", file=sys.stderr, flush=True)
    return LaunchResult(returncode, codes, failed, outputs)
