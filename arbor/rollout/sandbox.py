"""Run untrusted Python code in a subprocess; every outcome is a `SandboxResult` status.

A run is a fresh ``python -s -c PRELUDE`` in a new temporary working directory (deleted after),
its own session and process group, and an environment of only PATH and PYTHONHASHSEED=0. That
is ``python -I`` minus ``-E`` (which would ignore the fixed hash seed); the prelude drops ''
from sys.path, as ``-I`` does. The interpreter is sys.executable, or python3 on PATH when the
sandbox uid cannot run that one (a venv under a root-only home).

Invariants:
- Never raises on bad code. Status: "ok" (exit 0), "error" (non-zero exit / uncaught exception;
  stderr holds the traceback), "timeout" (wall clock past `timeout_s`, or RLIMIT_CPU),
  "memory" (MemoryError under RLIMIT_AS), "output_limit" (a stream passed the cap), "killed".
- Streams are read incrementally; at most `max_output_bytes` of each is kept, and the process
  group is SIGKILLed as soon as either passes it.
- When a run returns its process group has been SIGKILLed (and, as root, every process of its
  uid; with OS isolation, its PID namespace is gone): nothing it started stays alive.
- preexec_fn sets RLIMIT_CORE=0, CPU, FSIZE, NOFILE, NPROC and, last, AS. Linux never applies
  RLIMIT_NPROC to uid 0, so a root parent runs each program as a fresh uid (random in
  [2**20, 2**21)) whose count is that run alone; a non-root parent's uid owns other tasks,
  which count too, so its limit is their number plus `max_processes`.

Isolation (`network_isolation()` says which one runs): when ``unshare --user --map-root-user
--mount --net --pid --fork --kill-child`` works for the sandbox uid (with ``--mount-proc`` where
allowed), each run gets its own user, mount, network (loopback only) and PID namespaces. The prelude
then mounts private tmpfs of ``tmp_mb`` MiB on /tmp, /var/tmp and /dev/shm (nosuid, nodev), makes the
working directory inside that /tmp, and drops every capability (bounding set included, no new
privileges) before the program runs: the kernel enforces no network, everything the program writes
lives in its own tmpfs and is gone with its namespaces when the run ends, so nothing outlives a run
and no run can read another's files, and the run's death kills everything it forked.
The prelude also replaces `socket.socket` and friends (in `socket` and `_socket`) by ones raising
PermissionError("network disabled in sandbox"), a Python-level guard that ctypes or a child program
gets past.

Without namespaces (``unshare`` missing or refused, or ``os_isolation=False``) isolation is weak: no
kernel network barrier, /tmp and /dev/shm shared with the host. The sandbox then refuses to run code
(`SandboxUnavailable`) unless ``allow_weak_isolation`` is set (or ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION=1),
and logs once that it runs weakly: TMPDIR is the per-run working directory, files are created
private (umask 077), and as root the run's leftovers in /tmp, /var/tmp and /dev/shm (entries owned
by its fresh uid) are deleted after it; a non-root parent shares its uid with the program, which
can then signal the parent's processes and read what other runs leave in shared folders.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from arbor.rollout.sandbox_prelude import PRELUDE as _PRELUDE, PRIVATE as _PRIVATE

log = logging.getLogger(__name__)

_NAMESPACES = ("unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--kill-child")
_UNSHARES = (_NAMESPACES + ("--mount-proc",), _NAMESPACES)     # the first that works here
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
_FRESH_UID_BASE = 1 << 20
_FILE_SIZE_BYTES = 16 << 20
_OPEN_FILES = 256
_DRAIN_S = 1.0            # how long to wait for pipes to close once the run is over
_TRUNCATED = "\n[output truncated at {} bytes]"
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONHASHSEED": "0"}
@dataclass(frozen=True, slots=True)
class SandboxConfig:
    timeout_s: float = 5.0          # wall-clock limit
    memory_mb: int = 256            # RLIMIT_AS
    max_output_bytes: int = 4096    # cap per stream (stdout, stderr)
    max_processes: int = 16         # RLIMIT_NPROC (processes + threads of the run)
    cpu_s: int | None = None        # RLIMIT_CPU; None: ceil(timeout_s) + 1
    os_isolation: bool = True       # use unshare namespaces when they work here
    tmp_mb: int = 64                # size of each private tmpfs (/tmp, /var/tmp, /dev/shm)
    allow_weak_isolation: bool = field(   # run code even without namespaces (see the module docstring)
        default_factory=lambda: os.environ.get("ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION") == "1")


class SandboxUnavailable(RuntimeError):
    """Namespaces are unavailable here and weak isolation was not allowed."""


@dataclass(slots=True)
class SandboxResult:
    status: str             # "ok" | "error" | "timeout" | "memory" | "output_limit" | "killed"
    stdout: str             # at most max_output_bytes (+ a truncation marker)
    stderr: str
    exit_code: int | None   # negative: killed by that signal; None: never started
    wall_s: float
    pid: int | None = None  # pid of the session leader == the run's process group id
    network: str = "prelude"    # "unshare" (OS namespaces + prelude) or "prelude" alone
    timeout_s: float = 0.0

    def as_observation(self) -> str:
        """Short text for the model: stdout when ok, else stdout so far and a one-line reason."""
        if self.status == "ok":
            return self.stdout or "(no output)"
        tail = "\n".join(self.stderr.strip().splitlines()[-4:]) or f"exit code {self.exit_code}"
        reason = {"error": f"error: {tail}", "timeout": f"timeout after {self.timeout_s:g}s",
                  "memory": "error: MemoryError (memory limit exceeded)",
                  "output_limit": "error: output limit exceeded"}.get(self.status)
        out = self.stdout if not self.stdout or self.stdout.endswith("\n") else self.stdout + "\n"
        return out + (reason or f"killed by signal {-(self.exit_code or 0)}")


class _Launch(NamedTuple):
    prefix: tuple[str, ...]     # () or one of _UNSHARES
    python: str
    network: str                # "unshare" | "prelude"
    why_weak: str = ""          # why namespaces are not used ("" when they are)


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _child_setup(config: SandboxConfig, uid: int | None, nproc: int) -> None:
    """Runs in the forked child before exec. RLIMIT_AS goes last: the fork is a copy of a
    possibly large parent, and nothing may need to allocate after it is lowered."""
    cpu = config.cpu_s if config.cpu_s is not None else math.ceil(config.timeout_s) + 1
    os.umask(0o077)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_BYTES, _FILE_SIZE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_OPEN_FILES, _OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if uid is not None:
        _drop_to(uid)
    mem = config.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))


def _fresh_uid() -> int | None:
    return _FRESH_UID_BASE + secrets.randbelow(_FRESH_UID_BASE) if os.geteuid() == 0 else None


def _live_procs(uid: int) -> dict[int, int]:
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


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of a run's fresh uid, including ones that left its process group."""
    for _ in range(50):
        pids = _live_procs(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)


def _probe(argv: list[str], uid: int | None) -> tuple[str | None, str]:
    """(stdout when it exits 0 else None, the end of stderr)."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10, env=_ENV, cwd="/",
                           preexec_fn=(lambda: _drop_to(uid)) if uid is not None else None)
    except (OSError, subprocess.SubprocessError) as e:
        return None, str(e)
    return (r.stdout.strip() if r.returncode == 0 else None), r.stderr.strip()[-300:]


@functools.lru_cache(maxsize=None)
def _launch(os_isolation: bool) -> _Launch:
    """The first interpreter the sandbox uid can run (sys.executable, else python3 on PATH),
    under the first ``unshare`` that works and leaves only the loopback interface with a private /tmp."""
    uid = _fresh_uid()
    pythons = dict.fromkeys(p for p in (sys.executable, shutil.which("python3", path=_ENV["PATH"])) if p)
    check = _PRIVATE + "_private(1, 'probe')\nimport socket; print(len(socket.if_nameindex()))"
    skip = "os_isolation=False" if not os_isolation else "" if shutil.which("unshare") else "unshare is not installed"
    why = skip
    for py in pythons:
        if not skip:
            failures = []
            for prefix in _UNSHARES:
                out, err = _probe([*prefix, py, "-c", check], uid)
                if out == "1":
                    return _Launch(prefix, py, "unshare")
                failures.append(err or out or "no output")
            why = f"'{' '.join(_NAMESPACES)}' failed for the sandbox uid: {failures[-1]}"
        if _probe([py, "-c", "pass"], uid)[0] is not None:
            return _Launch((), py, "prelude", why)
    return _Launch((), sys.executable, "prelude", why or "no interpreter runs as the sandbox uid")


def network_isolation(os_isolation: bool = True) -> str:
    """"unshare" when runs get their own namespaces and private /tmp here, else "prelude"."""
    return _launch(os_isolation).network


def check_isolation(config: SandboxConfig) -> str:
    """→ "unshare" or (when allowed, logged once) "prelude"; SandboxUnavailable when runs would be weakly
    isolated and ``config.allow_weak_isolation`` is not set."""
    launch = _launch(config.os_isolation)
    if launch.network == "unshare":
        return "unshare"
    if not config.allow_weak_isolation:
        raise SandboxUnavailable(
            f"the sandbox cannot isolate tool code here ({launch.why_weak}); refusing to run it. To run it anyway "
            "with resource limits and a Python-level network guard only (no private /tmp, no kernel network "
            "barrier), set SandboxConfig(allow_weak_isolation=True) or ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION=1")
    _warn_weak(launch.why_weak)
    return "prelude"


@functools.lru_cache(maxsize=None)
def _warn_weak(why: str) -> None:
    log.warning("sandbox: running tool code with WEAK isolation (%s): rlimits and a Python-level network guard "
                "only; /tmp and /dev/shm are shared with the host", why)


def _remove_owned(uid: int) -> None:
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


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _pump(stream: asyncio.StreamReader, cap: int, sink: bytearray, on_overflow) -> bool:
    """Append at most `cap` bytes of `stream` to `sink`; True (after on_overflow()) past it."""
    while chunk := await stream.read(1 << 16):
        room = cap - len(sink)
        sink += chunk[:room]
        if len(chunk) > room:
            on_overflow()
            return True
    return False


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.write(data)
        await stream.drain()
        stream.close()


def _decode(buf: bytearray, cap: int, pump: asyncio.Future) -> str:
    text = buf.decode("utf-8", errors="replace")
    overflowed = pump.done() and not pump.cancelled() and pump.exception() is None and pump.result()
    return text + _TRUNCATED.format(cap) if overflowed else text


def _status(why: str | None, rc: int, stderr: str) -> str:
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


async def _wait_exit(proc, until: float, stop: list) -> None:
    """Poll `proc.returncode` (not `await proc.wait()`, which may also wait for the pipes that a
    leftover grandchild can hold open) until it is set, `stop` is non-empty, or `until`."""
    nap = 0.001
    while proc.returncode is None and not stop and time.monotonic() < until:
        await asyncio.sleep(nap)
        nap = min(2 * nap, 0.02)


async def run_python_async(code: str, config: SandboxConfig = SandboxConfig(), stdin: str = "") -> SandboxResult:
    """Run `code` as __main__ of a fresh sandboxed interpreter; see the module docstring.
    SandboxUnavailable (before anything runs) when isolation would be weak and that is not allowed."""
    start = time.monotonic()
    private = check_isolation(config) == "unshare"
    launch, uid = _launch(config.os_isolation), _fresh_uid()
    run_uid = uid
    nproc = config.max_processes + (sum(_live_procs(os.getuid()).values()) if uid is None else 0)
    tmp = tempfile.mkdtemp(prefix="arbor-sandbox-")
    proc, why, tasks, cap = None, [], [], config.max_output_bytes
    try:
        with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(tmp, uid, uid)
        extra = ["private", str(config.tmp_mb), os.path.basename(tmp)] if private else []
        try:
            proc = await asyncio.create_subprocess_exec(
                *launch.prefix, launch.python, "-s", "-c", _PRELUDE, *extra, cwd=tmp,
                env=_ENV if private else {**_ENV, "TMPDIR": tmp},
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, preexec_fn=functools.partial(_child_setup, config, uid, nproc))
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            return SandboxResult("error", "", f"sandbox could not start: {e}", None,
                                 time.monotonic() - start, None, launch.network, config.timeout_s)

        def kill(reason: str) -> None:
            why.append(reason)
            _killpg(proc.pid)

        out, err = bytearray(), bytearray()
        tasks = [asyncio.ensure_future(_pump(proc.stdout, cap, out, lambda: kill("output_limit"))),
                 asyncio.ensure_future(_pump(proc.stderr, cap, err, lambda: kill("output_limit"))),
                 asyncio.ensure_future(_feed(proc.stdin, stdin.encode()))]
        await _wait_exit(proc, start + config.timeout_s, why)
        if proc.returncode is None and not why:
            kill("timeout")
        _killpg(proc.pid)           # whatever is left of the tree once the leader is done
        if uid is not None:
            _kill_uid(uid)
            uid = None              # done: the finally clause need not scan /proc again
        await asyncio.wait(tasks[:2], timeout=_DRAIN_S)
        await _wait_exit(proc, time.monotonic() + _DRAIN_S, [])
        stderr, rc = _decode(err, cap, tasks[1]), proc.returncode
        status = _status(why[0] if why else None, rc if rc is not None else -signal.SIGKILL, stderr)
        return SandboxResult(status, _decode(out, cap, tasks[0]), stderr, rc, time.monotonic() - start,
                             proc.pid, launch.network, config.timeout_s)
    finally:
        for task in tasks:
            task.cancel()
        if proc is not None:
            _killpg(proc.pid)
            if uid is not None:
                _kill_uid(uid)
            proc._transport.close()     # no public close; else it warns when collected after the loop
        shutil.rmtree(tmp, ignore_errors=True)
        if not private and run_uid is not None:
            _remove_owned(run_uid)


def run_python(code: str, config: SandboxConfig = SandboxConfig(), stdin: str = "") -> SandboxResult:
    """Blocking `run_python_async`; safe to call with or without a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, config, stdin))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_python_async(code, config, stdin)).result()
