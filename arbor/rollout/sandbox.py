"""Run untrusted Python code in a subprocess; every outcome is a `SandboxResult` status.

A run is a fresh ``python -s -c PRELUDE`` (`arbor.rollout.sandbox_prelude`) in its own session and
process group, with an environment of only PATH and PYTHONHASHSEED=0 (plus LD_LIBRARY_PATH / PYTHONPATH
where the view needs them). That is ``python -I`` minus ``-E`` (which would ignore the fixed hash seed);
the prelude drops '' from sys.path, as ``-I`` does. The interpreter is the one running Arbor (the base
of its venv), or python3 on PATH when the sandbox uid cannot run that one (a venv under a root-only home).

Invariants:
- Never raises on bad code. Status: "ok" (exit 0), "error" (non-zero exit / uncaught exception;
  stderr holds the traceback), "timeout" (wall clock past `timeout_s`, or RLIMIT_CPU),
  "memory" (MemoryError under RLIMIT_AS), "output_limit" (a stream passed the cap), "killed".
  Under bwrap an exit status 128+N is read as signal N (as a shell does).
- Streams are read incrementally; at most `max_output_bytes` of each is kept, and the process
  group is SIGKILLed as soon as either passes it.
- When a run returns its process group has been SIGKILLed (and, as root, every process of its
  uid; with OS isolation, its PID namespace is gone): nothing it started stays alive.
- preexec_fn sets RLIMIT_CORE=0, CPU, FSIZE, NOFILE, NPROC and, last, AS. Linux never applies
  RLIMIT_NPROC to uid 0, so a root parent runs each program as a fresh uid (random in
  [2**20, 2**21)) whose count is that run alone; a non-root parent's uid owns other tasks,
  which count too, so its limit is their number plus `max_processes`.

Isolation (``SandboxConfig.isolation``; `network_isolation()` says which one runs):
- "bwrap" (bubblewrap, the default where it works): new user, mount, network (loopback only), PID,
  IPC and UTS namespaces, every capability dropped, and a filesystem view of the run's own
  (`arbor.rollout.sandbox_view`): the interpreter, its standard library, the system's shared
  libraries, the declared ``packages``, the ``files`` the environment hands it, a private /proc and
  /dev, and tmpfs of ``tmp_mb`` MiB on /tmp, /var/tmp and /dev/shm; nothing else of the host (no
  project checkout, no data files, no /etc, no home directories). Chosen over nsjail because it is
  packaged by Debian, Ubuntu, Fedora and Arch, needs no set-uid bit or config file where
  unprivileged user namespaces work, and is what Flatpak sandboxes applications with.
- "unshare" (without bwrap): ``unshare --user --map-root-user --mount --net --pid --ipc --uts --fork
  --kill-child`` runs `sandbox_prelude.STAGE`, which builds the same view with mount(2) and
  pivot_root, drops every capability and execs the interpreter.
- "auto": bwrap, else unshare. Everything the program writes lives in its tmpfs and is gone with its
  namespaces when the run ends, so nothing outlives a run and no run can read another's files.
The prelude also replaces `socket.socket` and friends (in `socket` and `_socket`) by ones raising
PermissionError("network disabled in sandbox"), a Python-level guard that ctypes or a child program
gets past.

Without namespaces ("none", or neither tool works here) isolation is weak: no kernel network barrier, the
host's filesystem readable, /tmp and /dev/shm shared with the host. The sandbox then refuses to run code
(`SandboxUnavailable`) unless ``allow_weak_isolation`` is set (or ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION=1),
and logs once that it runs weakly: TMPDIR is the per-run working directory, files are created
private (umask 077), and as root the run's leftovers in /tmp, /var/tmp and /dev/shm (entries owned
by its fresh uid) are deleted after it; a non-root parent shares its uid with the program, which
can then signal the parent's processes and read what other runs leave in shared folders. A
``bwrap`` or ``unshare`` asked for by name and unavailable is refused whatever that setting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from arbor.configs import check
from arbor.rollout.sandbox_process import (child_setup, decode, drop_to, feed, fresh_uid, kill_uid, killpg,
                                            exit_status, live_procs, pump, remove_owned, wait_exit)
from arbor.rollout.sandbox_prelude import PRELUDE as _PRELUDE, STAGE as _STAGE
from arbor.rollout.sandbox_view import PROBE as _PROBE, WORKDIR, Interpreter, bwrap_argv, check_files, view

log = logging.getLogger(__name__)

_UNSHARE = ("unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
            "--kill-child")
_MODES = {"auto": ("bwrap", "unshare"), "bwrap": ("bwrap",), "unshare": ("unshare",), "none": ()}
_DRAIN_S = 1.0            # how long to wait for pipes to close once the run is over
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONHASHSEED": "0"}
_VIEW_PATH = "/opt/python/bin"      # PATH inside the view: the interpreter (also as python3 and python)


@dataclass
class SandboxConfig:
    timeout_s: float = 5.0          # wall-clock limit of one program
    memory_mb: int = 256            # RLIMIT_AS
    max_output_bytes: int = 4096    # cap per stream (stdout, stderr)
    max_processes: int = 16         # RLIMIT_NPROC (processes + threads of the run)
    cpu_s: int = 0                  # RLIMIT_CPU seconds (0: ceil(timeout_s) + 1)
    isolation: str = "auto"         # auto (bwrap, else unshare) | bwrap | unshare | none (weak: needs allow_weak_isolation)
    tmp_mb: int = 64                # size of each private tmpfs (/tmp, /var/tmp, /dev/shm)
    packages: list[str] = field(default_factory=list)   # installed packages a program may import (and what they need), e.g. ["numpy"]
    files: dict = field(default_factory=dict)   # host paths a program sees, read-only: {"/data/repo" = "path/on/host"}
    allow_weak_isolation: bool = field(   # run code even without namespaces (see the module docstring)
        default_factory=lambda: os.environ.get("ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION") == "1")

    def validate(self) -> None:
        check(self, (self.timeout_s > 0, "timeout_s", "must be > 0"), (self.memory_mb >= 16, "memory_mb", "must be ≥ 16"),
              (self.max_output_bytes >= 1, "max_output_bytes", "must be ≥ 1"),
              (self.max_processes >= 1, "max_processes", "must be ≥ 1"), (self.cpu_s >= 0, "cpu_s", "must be ≥ 0"),
              (self.isolation in _MODES, "isolation", f"must be one of {', '.join(_MODES)}"),
              (self.tmp_mb >= 1, "tmp_mb", "must be ≥ 1"))
        check_files(self.files)


_default = SandboxConfig()


def configure(config: SandboxConfig) -> None:
    """Make ``config`` (a job's ``sandbox`` section) the one runs use when given none, e.g. the ``python`` tool's."""
    global _default
    config.validate()
    _default = config


def default_config() -> SandboxConfig:
    """The configuration runs use when given none (`configure`); ``dataclasses.replace`` it to vary one run,
    e.g. an environment handing a run its task's files."""
    return _default


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
    network: str = "prelude"    # "bwrap" | "unshare" (OS namespaces + prelude) or "prelude" alone
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
    mode: str                   # "bwrap" | "unshare" | "prelude"
    python: Interpreter
    why_weak: str = ""          # why namespaces are not used ("" when they are)
    with_proc: bool = True      # bwrap: a private procfs mounts here


def _probe(argv: list[str], uid: int | None, **kwargs) -> tuple[str | None, str]:
    """(stdout when it exits 0 else None, the end of stderr)."""
    kwargs = {"env": _ENV, "cwd": "/", "preexec_fn": (lambda: drop_to(uid)) if uid is not None else None, **kwargs}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10, **kwargs)
    except (OSError, subprocess.SubprocessError) as e:
        return None, str(e)
    return (r.stdout.strip() if r.returncode == 0 else None), r.stderr.strip()[-300:]


class _Run(NamedTuple):
    argv: list[str]
    env: dict[str, str]
    fds: list[int]          # passed to the child (bwrap's --file)
    cwd: str                # the host working folder (holds main.py)


@contextlib.contextmanager
def _prepared(launch: _Launch, config: SandboxConfig, code: str, uid: int | None):
    """The command of a run, with ``code`` as main.py in a fresh host folder (removed after)."""
    tmp, fds = tempfile.mkdtemp(prefix="arbor-sandbox-"), []
    try:
        main = os.path.join(tmp, "main.py")
        with open(main, "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(tmp, uid, uid)
        py = launch.python
        if launch.mode == "prelude":
            yield _Run([py.exe, "-s", "-c", _PRELUDE], {**_ENV, "TMPDIR": tmp}, fds, tmp)
            return
        ops, env = view(py, config.packages, config.files, config.tmp_mb, main, other_uid=uid is not None)
        env = {"PATH": _VIEW_PATH, "PYTHONHASHSEED": "0", **env}
        inner = [py.executable, "-s", "-c", _PRELUDE]
        if launch.mode == "bwrap":
            argv, fds = bwrap_argv(ops, env, launch.with_proc)
            yield _Run(argv + inner, _ENV, fds, tmp)
        else:
            spec = json.dumps({"ops": ops, "cwd": WORKDIR, "argv": inner, "env": env})
            yield _Run([*_UNSHARE, py.exe, "-I", "-S", "-c", _STAGE, spec], _ENV, fds, tmp)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


def _trial(launch: _Launch, uid: int | None, code: str, config: SandboxConfig | None = None) -> tuple[str | None, str]:
    config = config or SandboxConfig()
    with _prepared(launch, config, code, uid) as run:
        return _probe(run.argv, None, env=run.env, cwd=run.cwd, pass_fds=run.fds,
                      preexec_fn=functools.partial(child_setup, config, uid, 1 << 16))


def _interpreters(uid: int | None) -> list[Interpreter]:
    """The Pythons the sandbox uid can run: the base of the one running Arbor, then python3 on PATH."""
    exes = dict.fromkeys(p for p in (os.path.realpath(sys.executable), shutil.which("python3", path=_ENV["PATH"])) if p)
    found = []
    for exe in exes:
        out, _ = _probe([exe, "-I", "-S", "-c", _PROBE], uid)
        if out:
            found.append(Interpreter.from_probe(out))
    return found


_CHECK = "import os, socket\nprint(len(socket.if_nameindex()), os.path.exists('/etc/passwd'))"


@functools.lru_cache(maxsize=None)
def _launch(isolation: str) -> _Launch:
    """The first of ``isolation``'s modes that runs a program seeing only the loopback interface and none
    of the host's /etc, with the first interpreter it works with; else the prelude alone (why_weak says why)."""
    uid = fresh_uid()
    pythons = _interpreters(uid)
    if not pythons:
        own = Interpreter(sys.executable, sys.base_prefix, tuple(sys.version_info[:2]), (), (), "")
        return _Launch("prelude", own, "no interpreter runs as the sandbox uid")
    why = []
    for mode in _MODES[isolation]:
        if not shutil.which(mode):
            why.append(f"{mode} is not installed")
            continue
        tried = [_Launch(mode, py, "", proc) for py in pythons for proc in ((True, False) if mode == "bwrap" else (True,))]
        for launch in tried:
            out, err = _trial(launch, uid, _CHECK)
            if out == "1 False":
                return launch
        why.append(f"{mode} failed for the sandbox uid: {err or out or 'no output'}")
    return _Launch("prelude", pythons[0], "; ".join(why) or f"isolation={isolation}")


def network_isolation(isolation: str = "auto") -> str:
    """"bwrap" or "unshare" when runs get their own namespaces and filesystem view here, else "prelude"."""
    return _launch(isolation).mode


def check_isolation(config: SandboxConfig | None = None) -> str:
    """→ "bwrap", "unshare" or (when allowed, logged once) "prelude"; SandboxUnavailable when runs would be
    weakly isolated and ``config.allow_weak_isolation`` is not set (or a mode asked for by name does not
    work). The first time a config declares packages or files, one run checks that they import / exist."""
    config = _default if config is None else config
    launch = _launch(config.isolation)
    if launch.mode != "prelude":
        if config.packages or config.files:
            _check_view(launch, tuple(config.packages), tuple(sorted(config.files.items())))
        return launch.mode
    if config.isolation in ("bwrap", "unshare"):
        raise SandboxUnavailable(f"sandbox.isolation={config.isolation} does not work here ({launch.why_weak}); "
                                 "use isolation=auto, or install bubblewrap (apt-get install bubblewrap)")
    if not config.allow_weak_isolation:
        raise SandboxUnavailable(
            f"the sandbox cannot isolate tool code here ({launch.why_weak}); refusing to run it. Install bubblewrap "
            "(apt-get install bubblewrap) or allow unprivileged user namespaces; to run it anyway with resource "
            "limits and a Python-level network guard only (the host's files readable, no kernel network barrier), "
            "set SandboxConfig(allow_weak_isolation=True) or ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION=1")
    _warn_weak(launch.why_weak)
    return "prelude"


@functools.lru_cache(maxsize=None)
def _check_view(launch: _Launch, packages: tuple[str, ...], files: tuple[tuple[str, str], ...]) -> None:
    """One run that imports the declared packages (those importable by name here) and reads the given files
    (lists a folder, opens a file)."""
    if packages and launch.python.version != tuple(sys.version_info[:2]):
        raise ValueError(
            f"sandbox.packages: the sandbox runs Python {'.'.join(map(str, launch.python.version))} "
            f"({launch.python.exe}: the sandbox uid cannot run {os.path.realpath(sys.executable)}), whose packages "
            f"cannot be this Python {sys.version_info[0]}.{sys.version_info[1]}'s; put Python where other users can "
            "read it (not under a root-only home) or run as a non-root user")
    imports = [p for p in packages if importlib.util.find_spec(p) is not None]
    code = "".join(f"import {p}\n" for p in imports) + "".join(
        f"import os\nos.listdir({d!r}) if os.path.isdir({d!r}) else open({d!r}, 'rb').close()\n" for d, _ in files)
    config = SandboxConfig(timeout_s=30.0, memory_mb=4096, packages=list(packages), files=dict(files))
    out, err = _trial(launch, fresh_uid(), code, config)
    if out is None:
        hint = (" (Arbor runs as root, so the sandbox runs as a fresh uid: what it is given must be readable by "
                "other users inside its folder)") if os.geteuid() == 0 else ""
        raise ValueError(f"sandbox.packages / sandbox.files: a sandboxed program could not import {imports} or see "
                         f"{[d for d, _ in files]}{hint}: {err}")


@functools.lru_cache(maxsize=None)
def _warn_weak(why: str) -> None:
    log.warning("sandbox: running tool code with WEAK isolation (%s): rlimits and a Python-level network guard "
                "only; /tmp and /dev/shm are shared with the host", why)


async def run_python_async(code: str, config: SandboxConfig | None = None, stdin: str = "") -> SandboxResult:
    """Run `code` as __main__ of a fresh sandboxed interpreter (``config``: `default_config()`); see the
    module docstring. SandboxUnavailable (before anything runs) when isolation would be weak and that is
    not allowed."""
    start = time.monotonic()
    config = _default if config is None else config
    mode = check_isolation(config)
    launch, uid = _launch(config.isolation), fresh_uid()
    run_uid = uid
    nproc = config.max_processes + (sum(live_procs(os.getuid()).values()) if uid is None else 0)
    proc, why, tasks, cap = None, [], [], config.max_output_bytes
    with _prepared(launch, config, code, uid) as run:
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *run.argv, cwd=run.cwd, env=run.env, pass_fds=run.fds,
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True, preexec_fn=functools.partial(child_setup, config, uid, nproc))
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                return SandboxResult("error", "", f"sandbox could not start: {e}", None,
                                     time.monotonic() - start, None, mode, config.timeout_s)

            def kill(reason: str) -> None:
                why.append(reason)
                killpg(proc.pid)

            out, err = bytearray(), bytearray()
            tasks = [asyncio.ensure_future(pump(proc.stdout, cap, out, lambda: kill("output_limit"))),
                     asyncio.ensure_future(pump(proc.stderr, cap, err, lambda: kill("output_limit"))),
                     asyncio.ensure_future(feed(proc.stdin, stdin.encode()))]
            await wait_exit(proc, start + config.timeout_s, why)
            if proc.returncode is None and not why:
                kill("timeout")
            killpg(proc.pid)           # whatever is left of the tree once the leader is done
            if uid is not None:
                kill_uid(uid)
                uid = None              # done: the finally clause need not scan /proc again
            await asyncio.wait(tasks[:2], timeout=_DRAIN_S)
            await wait_exit(proc, time.monotonic() + _DRAIN_S, [])
            stderr, rc = decode(err, cap, tasks[1]), proc.returncode
            if mode == "bwrap" and rc is not None and rc > 128:
                rc = 128 - rc           # bwrap exits 128+N when its child dies of signal N
            status = exit_status(why[0] if why else None, rc if rc is not None else -signal.SIGKILL, stderr)
            return SandboxResult(status, decode(out, cap, tasks[0]), stderr, rc, time.monotonic() - start,
                                 proc.pid, mode, config.timeout_s)
        finally:
            for task in tasks:
                task.cancel()
            if proc is not None:
                killpg(proc.pid)
                if uid is not None:
                    kill_uid(uid)
                proc._transport.close()     # no public close; else it warns when collected after the loop
            if mode == "prelude" and run_uid is not None:
                remove_owned(run_uid)


def run_python(code: str, config: SandboxConfig | None = None, stdin: str = "") -> SandboxResult:
    """Blocking `run_python_async`; safe to call with or without a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python_async(code, config, stdin))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_python_async(code, config, stdin)).result()
