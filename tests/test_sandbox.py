"""Hostile inputs for arbor.rollout.sandbox: each must end in a clear status, leave no live
process behind, leave no file for the next run, and leave the parent (this pytest process) working
and unlimited. Configs allow weak isolation (so the suite runs where namespaces do not) except where
the refusal itself is tested."""

import asyncio
import os
import resource

import pytest

from arbor.rollout import sandbox
from arbor.rollout.sandbox import (SandboxConfig, SandboxUnavailable, network_isolation, run_python,
                                    run_python_async)

FAST = SandboxConfig(timeout_s=10.0, allow_weak_isolation=True)   # ample: these tests check results, not limits
MODES = [m for m in ("bwrap", "unshare") if network_isolation(m) == m] + ["none"]   # the isolations that work here


def live_in_group(pgid: int) -> list[int]:
    """Pids of non-zombie processes whose process group is `pgid`."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(p))
    return pids


def is_live(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ok_stdout_and_stdin():
    r = run_python("import sys\nprint('hi', sys.stdin.read().upper())", FAST, stdin="abc")
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "hi ABC\n")
    assert r.as_observation() == "hi ABC\n"
    assert run_python("x = 1", FAST).as_observation() == "(no output)"


def test_syntax_error_and_exception_give_traceback_tail():
    r = run_python("def f(:\n    pass", FAST)
    assert r.status == "error" and r.exit_code != 0
    assert "SyntaxError" in r.as_observation() and r.as_observation().startswith("error:")
    r = run_python("print('before')\n1 / 0", FAST)
    assert r.status == "error" and r.stdout == "before\n"
    assert "ZeroDivisionError" in r.as_observation() and 'File "main.py", line 2' in r.stderr
    assert "<string>" not in r.stderr    # the prelude's own frame is not shown


@pytest.mark.parametrize("isolation", MODES)
def test_infinite_loop_times_out(isolation):
    cfg = SandboxConfig(timeout_s=1.0, isolation=isolation, allow_weak_isolation=True)
    r = run_python("while True:\n    pass", cfg)
    assert r.status == "timeout" and r.wall_s < cfg.timeout_s + 1.0
    assert r.as_observation() == "timeout after 1s"
    assert live_in_group(r.pid) == []


@pytest.mark.parametrize("isolation", MODES)
def test_fork_bomb_is_contained(isolation):
    cfg = SandboxConfig(timeout_s=2.0, max_processes=16, isolation=isolation, allow_weak_isolation=True)
    r = run_python("import os\nwhile True:\n    os.fork()", cfg)
    assert r.status in ("timeout", "error", "killed")
    assert r.wall_s < cfg.timeout_s + 1.0
    assert live_in_group(r.pid) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="escapees are found by the fresh uid a root parent uses")
@pytest.mark.parametrize("isolation", MODES)
def test_child_that_leaves_the_group_is_killed(isolation):
    code = ("import os, time\nr, w = os.pipe()\npid = os.fork()\nif pid == 0:\n"
            "    os.setsid()\n    os.write(w, b'x')\n    time.sleep(60)\nos.read(r, 1)\nprint(pid)")
    r = run_python(code, SandboxConfig(timeout_s=2.0, isolation=isolation, allow_weak_isolation=True))
    assert r.status == "ok"
    if isolation == "none":   # else that pid is in a dead PID namespace
        assert not is_live(int(r.stdout))


@pytest.mark.parametrize("code", ["x = bytearray(10**10)",
                                  "x = []\nwhile True:\n    x.append(' ' * 10**6)"])
def test_memory_hog(code):
    r = run_python(code, SandboxConfig(timeout_s=3.0, memory_mb=256, allow_weak_isolation=True))
    assert r.status == "memory", (r.status, r.stderr[-300:])
    assert "MemoryError" in r.as_observation()


@pytest.mark.parametrize("stream", ["sys.stdout", "sys.stderr"])
def test_huge_output_is_capped_and_killed_early(stream):
    cfg = SandboxConfig(timeout_s=3.0, max_output_bytes=4096, allow_weak_isolation=True)
    r = run_python(f"import sys\nwhile True:\n    print('x' * 1000, file={stream})", cfg)
    assert r.status == "output_limit" and r.wall_s < 1.5
    marker = "\n[output truncated at 4096 bytes]"
    text = r.stdout if stream == "sys.stdout" else r.stderr
    assert text.endswith(marker) and len(text.encode()) <= 4096 + len(marker)
    assert "output limit" in r.as_observation()


@pytest.mark.parametrize("code", ['import socket\nsocket.create_connection(("127.0.0.1", 9))',
                                  "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
                                  "import _socket\n_socket.socket()",
                                  "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')"])
def test_network_is_disabled(code):
    r = run_python(code, FAST)
    assert r.status == "error" and "network disabled in sandbox" in r.as_observation()


def test_os_network_isolation_when_available():
    assert network_isolation() in ("bwrap", "unshare", "prelude")
    r = run_python("import socket\nprint(len(socket.if_nameindex()))", FAST)
    assert r.network == network_isolation()
    if r.network != "prelude":
        assert r.stdout == "1\n"        # loopback only


def test_clean_env_fixed_hash_seed_and_deleted_workdir():
    code = "import os, sys\nprint(hash('arbor'))\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint('' in sys.path)"
    a, b = run_python(code, FAST), run_python(code, FAST)
    assert a.status == b.status == "ok"
    hash_a, env, cwd, empty_in_path = a.stdout.splitlines()
    assert hash_a == b.stdout.splitlines()[0]
    assert set(eval(env)) <= {"PATH", "PYTHONHASHSEED", "LC_CTYPE", "LD_LIBRARY_PATH", "PWD"} and empty_in_path == "False"
    assert not os.path.exists(cwd)


def test_concurrent_async_runs():
    async def main():
        return await asyncio.gather(*(run_python_async(f"import time\ntime.sleep(0.2)\nprint({i} * {i})", FAST)
                                      for i in range(8)))
    results = asyncio.run(main())
    assert [r.status for r in results] == ["ok"] * 8
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


def test_sync_api_inside_a_running_loop():
    async def main():
        return run_python("print(7)", FAST)
    assert asyncio.run(main()).stdout == "7\n"


def test_parent_is_unaffected():
    limits = [resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_CPU)]
    hostile = ["import sys\nsys.exit(3)", "raise SystemExit('bye')"]
    if os.geteuid() == 0:   # a non-root parent shares its uid with prelude-only runs, which could kill it
        hostile.append("import os\nos.kill(os.getppid(), 9)")
    for code in hostile:
        r = run_python(code, FAST)
        assert r.status in ("error", "ok", "killed")
    assert run_python("import sys\nsys.exit(3)", FAST).exit_code == 3
    assert [resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_CPU)] == limits
    assert run_python("print(sum(range(10)))", FAST).stdout == "45\n"


NAMESPACES = pytest.mark.skipif(network_isolation() == "prelude", reason="needs user/mount namespaces")
LEFTOVERS = {"/tmp": "'/tmp/arbor-left-{}'", "/var/tmp": "'/var/tmp/arbor-left-{}'",
             "/dev/shm": "'/dev/shm/arbor-left-{}'", "cwd": "'arbor-left-{}'",
             "tempfile": "__import__('tempfile').gettempdir() + '/arbor-left-{}'"}


def write_then_read(tag: str, place: str, cfg: SandboxConfig):
    """Run 1 writes a secret at the place and prints its absolute path; run 2 tries to read it."""
    path = LEFTOVERS[place].format(tag)
    first = run_python(f"import os\np = {path}\nopen(p, 'w').write('secret')\n"
                       "print(open(p).read(), os.path.abspath(p))", cfg)
    second = run_python(f"p = {path}\ntry:\n    print(open(p).read())\nexcept OSError as e:\n"
                        "    print(type(e).__name__)", cfg)
    assert first.status == "ok" and first.stdout.startswith("secret"), first
    return first.stdout.split()[1], second.stdout


@NAMESPACES
@pytest.mark.parametrize("place", sorted(LEFTOVERS))
def test_a_run_cannot_read_what_the_previous_run_wrote(place):
    path, second = write_then_read(f"ns{place.replace('/', '-')}", place, FAST)
    assert second == "FileNotFoundError\n"
    assert not os.path.exists(path)         # it never reached the host's folders either


@NAMESPACES
def test_private_tmp_holds_only_the_run_and_is_size_limited():
    r = run_python("import os\nprint(sorted(os.listdir('/tmp')), os.listdir('/dev/shm'))", FAST)
    assert r.stdout == "['run'] []\n", r.stdout
    cfg = SandboxConfig(timeout_s=3.0, tmp_mb=1, allow_weak_isolation=True)
    for where in ("/tmp/big", "/dev/shm/big", "big"):
        r = run_python(f"open({where!r}, 'wb').write(b'x' * (3 << 20))", cfg)
        assert r.status == "error" and "No space left on device" in r.stderr, (where, r.stderr[-300:])


@NAMESPACES
def test_the_program_holds_no_capability():
    code = "for line in open('/proc/self/status'):\n    if line.startswith('Cap'):\n        print(line.split()[1])"
    r = run_python(code, FAST)
    assert r.stdout.split() == ["0000000000000000"] * 5, r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root parent cannot tell a run's files from its own")
@pytest.mark.parametrize("place", sorted(LEFTOVERS))
def test_weak_isolation_still_removes_a_runs_files(place):
    cfg = SandboxConfig(timeout_s=2.0, isolation="none", allow_weak_isolation=True)
    path, second = write_then_read(f"weak{place.replace('/', '-')}", place, cfg)
    assert second == "FileNotFoundError\n"
    assert not os.path.exists(path)


def test_weak_isolation_is_refused_unless_allowed(monkeypatch, caplog):
    monkeypatch.delenv("ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION", raising=False)
    with pytest.raises(SandboxUnavailable, match="isolation=none"):
        run_python("print(1)", SandboxConfig(isolation="none"))
    sandbox._warn_weak.cache_clear()
    allowed = SandboxConfig(isolation="none", allow_weak_isolation=True)
    with caplog.at_level("WARNING", logger="arbor.rollout.sandbox"):
        assert [run_python("print(1)", allowed).stdout for _ in range(2)] == ["1\n", "1\n"]
    assert len([r for r in caplog.records if "WEAK isolation" in r.getMessage()]) == 1
    monkeypatch.setenv("ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION", "1")
    assert SandboxConfig(isolation="none").allow_weak_isolation


def test_without_bwrap_and_unshare_the_sandbox_refuses(monkeypatch):
    """A machine without bwrap and unshare (PATH without them): refused, naming why."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("ARBOR_SANDBOX_ALLOW_WEAK_ISOLATION", raising=False)
    sandbox._launch.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="unshare is not installed"):
            run_python("print(1)", SandboxConfig())
        assert network_isolation() == "prelude"
    finally:
        sandbox._launch.cache_clear()
