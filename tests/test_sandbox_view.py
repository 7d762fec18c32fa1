"""The sandbox's filesystem view (arbor.rollout.sandbox_view): a program sees the interpreter, its
standard library, the declared packages and the files it is handed, and nothing else of the host —
not the project checkout, not the job's data, not /etc or home directories. Every hidden path must be
absent (FileNotFoundError), not merely unreadable: the sandbox before the view gave the contents or
PermissionError for each of them. Each case runs under every isolation that works here (bwrap, unshare)."""

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from arbor.rollout import sandbox
from arbor.rollout.sandbox import SandboxConfig, check_isolation, network_isolation, run_python

ISOLATED = [m for m in ("bwrap", "unshare") if network_isolation(m) == m]
pytestmark = pytest.mark.skipif(not ISOLATED, reason="needs bwrap or unprivileged user namespaces")
CHECKOUT = Path(__file__).resolve().parents[1]
OPS = {"open": "open({!r}).read()", "list": "os.listdir({!r})", "stat": "os.stat({!r})"}


def probe(path: str, op: str, cfg: SandboxConfig) -> str:
    """What a program gets when it tries ``op`` on ``path``: "visible" or the exception's name."""
    code = f"import os\ntry:\n    {OPS[op].format(path)}\n    print('visible')\nexcept OSError as e:\n    print(type(e).__name__)"
    r = run_python(code, cfg)
    assert r.status == "ok", r
    return r.stdout.strip()


@pytest.fixture(scope="module")
def data_file():
    """A job's training file with its answers, world-readable, beside the checkout (outside /tmp, which
    was private before the view too)."""
    folder = CHECKOUT / f".sandbox-view-test-{os.getpid()}"
    folder.mkdir()
    folder.chmod(0o755)
    path = folder / "train.jsonl"
    path.write_text('{"prompt": "What is 2 + 2?", "answer": "4"}\n')
    path.chmod(0o644)
    yield path
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def handed():
    """A folder the environment hands a run: world-readable, so the sandbox uid may bind it."""
    folder = tempfile.mkdtemp(prefix="arbor-handed-", dir="/var/tmp")
    os.chmod(folder, 0o755)
    Path(folder, "notes.txt").write_text("given\n")
    os.chmod(Path(folder, "notes.txt"), 0o644)
    yield folder
    shutil.rmtree(folder)


TARGETS = [("checkout", "list"), ("checkout", "stat"), ("README", "open"), ("README", "stat"),
           ("data", "open"), ("data", "stat"), ("data folder", "list"), ("/etc/passwd", "open"),
           ("/etc/passwd", "stat"), ("/etc", "list"), ("/root", "list"), ("/root", "stat"), ("/home", "stat"),
           ("/usr/bin", "stat"), ("/usr/local", "stat"), ("/var/lib", "stat"), ("interpreter prefix", "stat")]


@pytest.mark.parametrize("isolation", ISOLATED)
@pytest.mark.parametrize("target,op", TARGETS, ids=[f"{t}-{o}" for t, o in TARGETS])
def test_host_paths_are_absent(isolation, target, op, data_file):
    path = {"checkout": str(CHECKOUT), "README": str(CHECKOUT / "README.md"), "data": str(data_file),
            "data folder": str(data_file.parent), "interpreter prefix": sys.base_prefix}.get(target, target)
    assert probe(path, op, SandboxConfig(isolation=isolation)) == "FileNotFoundError"


def test_without_a_view_the_probe_sees_the_host():
    """The probe itself can fail: weak isolation shows the host's files."""
    weak = SandboxConfig(isolation="none", allow_weak_isolation=True)
    assert probe("/usr/bin", "stat", weak) == "visible"
    assert probe(sys.base_prefix, "stat", weak) in ("visible", "PermissionError")


@pytest.mark.parametrize("isolation", ISOLATED)
def test_the_view_holds_only_its_own_folders(isolation):
    r = run_python("import os\nprint((sorted(os.listdir('/')), sorted(os.listdir('/usr')), os.listdir('/opt'), "
                   "os.getcwd(), sorted(os.listdir('/dev'))))", SandboxConfig(isolation=isolation))
    top, usr, opt, cwd, dev = eval(r.stdout)
    libs = {os.path.basename(d) for d in ("/lib", "/lib32", "/lib64", "/libx32") if os.path.lexists(d)}
    assert set(top) == {"dev", "opt", "proc", "tmp", "usr", "var"} | libs, top
    assert set(usr) <= {"lib", "lib32", "lib64", "libx32"} and opt == ["python"] and cwd == "/tmp/run"
    assert {"null", "zero", "urandom"} <= set(dev) <= {"null", "zero", "full", "random", "urandom", "tty", "fd",
                                                       "stdin", "stdout", "stderr", "shm", "pts", "ptmx", "core"}


@pytest.mark.parametrize("isolation", ISOLATED)
def test_nothing_outside_the_tmpfs_is_writable(isolation):
    code = ("import os\nfor p in ('/x', '/opt/x', '/opt/python/x', '/dev/x', '/usr/lib/x', '/tmp/x', '/dev/shm/x'):\n"
            "    try:\n        open(p, 'w').close()\n        print(p, 'written')\n"
            "    except OSError as e:\n        print(p, type(e).__name__)")
    lines = run_python(code, SandboxConfig(isolation=isolation)).stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["OSError"] * 5 + ["written"] * 2, lines


STDLIB = "json sqlite3 decimal ssl ctypes zlib lzma bz2 hashlib uuid fractions datetime multiprocessing csv".split()


@pytest.mark.parametrize("isolation", ISOLATED)
def test_the_standard_library_imports_and_the_interpreter_runs_itself(isolation):
    code = (f"import {', '.join(STDLIB)}, subprocess, sys\nprint(sqlite3.connect(':memory:').execute('select 6*7').fetchone()[0])\n"
            "print(subprocess.run([sys.executable, '-c', 'print(2)'], capture_output=True, text=True).stdout.strip())\n"
            "print(subprocess.run(['python3', '-c', 'print(3)'], capture_output=True, text=True).stdout.strip())")
    r = run_python(code, SandboxConfig(isolation=isolation))
    assert r.stdout.split() == ["42", "2", "3"], r


def same_python(isolation: str) -> bool:
    return sandbox._launch(isolation).python.version == tuple(sys.version_info[:2])


@pytest.mark.parametrize("isolation", ISOLATED)
def test_declared_packages_import_with_what_they_need_and_no_others(isolation):
    if not same_python(isolation):
        pytest.skip("the sandbox uid runs another Python than this one")
    render = "import jinja2\nprint(jinja2.Template('{{ x|e }}').render(x='<b>'))"   # jinja2 needs markupsafe
    assert run_python(render, SandboxConfig(isolation=isolation, packages=["jinja2"])).stdout == "&lt;b&gt;\n"
    undeclared = run_python(render, SandboxConfig(isolation=isolation))
    assert "ModuleNotFoundError: No module named 'jinja2'" in undeclared.stderr
    other = run_python("import numpy", SandboxConfig(isolation=isolation, packages=["jinja2"]))
    assert "No module named 'numpy'" in other.stderr


@pytest.mark.parametrize("isolation", ISOLATED)
def test_files_the_environment_hands_a_run_are_there_read_only(isolation, handed):
    cfg = SandboxConfig(isolation=isolation, files={"/data/task": handed})
    code = ("import os\nprint(open('/data/task/notes.txt').read().strip(), os.listdir('/data/task'))\n"
            "try:\n    open('/data/task/new.txt', 'w')\nexcept OSError as e:\n    print(e.strerror)")
    assert run_python(code, cfg).stdout.splitlines() == ["given ['notes.txt']", "Read-only file system"]
    assert probe("/data/task", "stat", SandboxConfig(isolation=isolation)) == "FileNotFoundError"  # not by default
    assert not Path(handed, "new.txt").exists()


def test_bad_sandbox_settings_are_refused_naming_the_key(handed):
    for files, why in [({"data": handed}, "must be absolute"), ({"/opt/python/x": handed}, "part of the sandbox's own view"),
                       ({"/tmp": handed}, "part of the sandbox's own view"), ({"/data": "/no/such/path"}, "does not exist")]:
        with pytest.raises(ValueError, match=why):
            SandboxConfig(files=files).validate()
    with pytest.raises(ValueError, match="isolation must be one of"):
        SandboxConfig(isolation="bubblewrap").validate()
    with pytest.raises(ValueError, match="'no-such-package' is not installed"):
        check_isolation(SandboxConfig(packages=["no-such-package"]))


def test_the_job_config_sets_the_python_tools_sandbox(handed):
    from arbor.configs import load
    from arbor.tasks.python_tool import python
    from arbor.train.config import RLConfig
    cfg = load(RLConfig, overrides=[f'sandbox.files={{"/data/task" = "{handed}"}}', "sandbox.timeout_s=7"])
    assert cfg.sandbox.files == {"/data/task": handed} and cfg.sandbox.timeout_s == 7.0
    before = sandbox.default_config()
    try:
        sandbox.configure(cfg.sandbox)
        assert asyncio.run(python("print(open('/data/task/notes.txt').read())")) == "given\n\n"
    finally:
        sandbox.configure(before)
    with pytest.raises(ValueError, match="sandbox.isolation must be one of"):
        load(RLConfig, overrides=["sandbox.isolation=bwarp"])


@pytest.mark.skipif("unshare" not in ISOLATED, reason="needs unprivileged user namespaces")
def test_auto_falls_back_to_unshare_without_bwrap(monkeypatch, tmp_path):
    """A machine with unshare but no bwrap (PATH holding only unshare): auto builds the view with unshare."""
    os.symlink(shutil.which("unshare"), tmp_path / "unshare")
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._launch.cache_clear()
    try:
        assert network_isolation("auto") == "unshare"
        assert probe(str(CHECKOUT), "stat", SandboxConfig()) == "FileNotFoundError"
    finally:
        sandbox._launch.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0, reason="a fresh uid runs the program only under a root parent")
@pytest.mark.parametrize("isolation", ISOLATED)
def test_a_folder_the_sandbox_uid_cannot_read_is_handed_as_a_copy(isolation):
    """As root, a private folder (0700, as a venv in a mktemp checkout) is bound as a readable copy."""
    with tempfile.TemporaryDirectory() as private:
        Path(private, "answer.txt").write_text("42\n")
        cfg = SandboxConfig(isolation=isolation, files={"/data": private})
        check_isolation(cfg)
        assert run_python("print(open('/data/answer.txt').read().strip(), end='')", cfg).stdout == "42"
