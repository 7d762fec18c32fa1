"""The filesystem a sandboxed program sees: a list of mount operations, built by ``bwrap`` or, without it,
by the fallback's first stage (``sandbox_prelude.STAGE``) under ``unshare``, so both give the same view.

The view, all read-only but the tmpfs:
- the system's shared libraries (``/usr/lib``, ``/usr/lib64``, … and ``/lib*``, as directories or the
  symlinks they are on the host); no ``/etc``, ``/home``, ``/root``, ``/usr/bin``, ``/usr/share``, ``/usr/local``;
- the interpreter relocated to ``/opt/python`` (its executable, standard library, libpython), its own
  site-packages hidden under an empty read-only tmpfs: Python finds its prefix from the executable's
  place (the ``lib/pythonX.Y/os.py`` landmark), so nothing of the host prefix's path shows;
- the declared packages (``SandboxConfig.packages``) with their installed dependencies, each top-level
  entry of their installed files bound in ``/opt/packages`` (PYTHONPATH);
- the files the environment hands the run (``SandboxConfig.files``: {path in the sandbox: host path}).
  A root parent runs programs as a fresh uid, which cannot reach what sits in a private folder (a venv
  in a 0700 checkout, files under /root): such a package or file is bound as a copy that other users
  can read, made once per process and source version (top-level mtime) and deleted at exit;
- a private ``/proc`` (its own PID namespace), a ``/dev`` of null, zero, full, random, urandom and tty,
  tmpfs of ``tmp_mb`` MiB on ``/tmp``, ``/var/tmp`` and ``/dev/shm``, the working directory ``/tmp/run``
  holding ``main.py``; ``/`` and ``/dev`` are remounted read-only last.

An operation is a tuple: ("bind", host, dest), ("symlink", target, dest), ("tmpfs", dest, bytes or 0),
("remount-ro", dest), ("proc", dest), ("dev", dest), ("dir", dest), ("file", host, dest) (a writable copy).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
import sys
import tempfile
from importlib import metadata
from typing import NamedTuple

PYTHON_ROOT = "/opt/python"
PACKAGES_ROOT = "/opt/packages"
WORKDIR = "/tmp/run"
_LIBRARY_DIRS = ("/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/lib", "/lib32", "/lib64", "/libx32")
_RESERVED = ("/opt/python", "/opt/packages", "/proc", "/dev", "/usr", "/lib", "/lib32", "/lib64", "/libx32")

# Run by a candidate interpreter (``-I -S -c``): what the view must hold for it.
PROBE = r'''
import json, os, sys, sysconfig
v = sysconfig.get_config_vars()
print(json.dumps({"exe": os.path.realpath(sys.executable), "prefix": os.path.realpath(sys.base_prefix),
    "version": list(sys.version_info[:2]),
    "stdlib": sorted({os.path.realpath(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib")}),
    "site": sorted({os.path.realpath(sysconfig.get_path(k)) for k in ("purelib", "platlib")}),
    "libpython": os.path.realpath(os.path.join(v["LIBDIR"], v["INSTSONAME"])) if v.get("Py_ENABLE_SHARED") else ""}))
'''


class Interpreter(NamedTuple):
    """A Python the sandbox runs, from `PROBE`'s output."""
    exe: str                    # host path of the executable
    prefix: str
    version: tuple[int, int]
    stdlib: tuple[str, ...]
    site: tuple[str, ...]
    libpython: str              # "" when statically linked

    @classmethod
    def from_probe(cls, text: str) -> "Interpreter":
        d = json.loads(text)
        return cls(d["exe"], d["prefix"], tuple(d["version"]), tuple(d["stdlib"]), tuple(d["site"]), d["libpython"])

    def inside(self, host: str) -> str:
        """Where a host path of this interpreter appears in the view."""
        rel = os.path.relpath(host, self.prefix)
        return f"{PYTHON_ROOT}/{rel}" if not rel.startswith("..") else host

    @property
    def executable(self) -> str:
        return f"{PYTHON_ROOT}/bin/{os.path.basename(self.exe)}"


def _libraries() -> list[tuple]:
    ops = []
    for d in _LIBRARY_DIRS:
        if os.path.islink(d):
            ops.append(("symlink", os.readlink(d), d))
        elif os.path.isdir(d):
            ops.append(("bind", d, d))
    return sorted(ops, key=lambda op: op[0] == "symlink")     # a symlink may point into a bound dir


def _interpreter(py: Interpreter) -> tuple[list[tuple], dict[str, str]]:
    ops = [("bind", py.exe, py.executable)] + [("bind", d, py.inside(d)) for d in py.stdlib]
    ops += [("symlink", os.path.basename(py.exe), f"{PYTHON_ROOT}/bin/{name}") for name in ("python3", "python")
            if name != os.path.basename(py.exe)]
    env = {}
    if py.libpython:
        ops.append(("bind", py.libpython, py.inside(py.libpython)))
        env["LD_LIBRARY_PATH"] = os.path.dirname(py.inside(py.libpython))
    for site in py.site:            # its own packages: hidden (the declared ones come from /opt/packages)
        if os.path.isdir(site) and any(site.startswith(d + "/") for d in py.stdlib):
            ops += [("tmpfs", py.inside(site), 0), ("remount-ro", py.inside(site))]
    return ops, env


def _distribution(name: str) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        dists = metadata.packages_distributions().get(name, [])
        if not dists:
            raise ValueError(f"sandbox.packages: {name!r} is not installed in this Python ({sys.prefix}); "
                             "install it (pip install …) or remove it from sandbox.packages") from None
        return metadata.distribution(dists[0])


def _requirements(dist: metadata.Distribution) -> list[str]:
    """The names of the distributions ``dist`` needs (no extras; markers evaluated for this Python)."""
    from packaging.requirements import Requirement
    names = []
    for text in dist.requires or ():
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def package_sources(names) -> list[str]:
    """Host paths (package folders, modules, vendored ``*.libs``, ``*.dist-info``) of the installed
    distributions ``names`` and everything they require, each a top-level entry of a site folder."""
    seen, queue, paths = set(), [_distribution(n) for n in names], {}
    while queue:
        dist = queue.pop()
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for f in dist.files or ():
            if f.parts and f.parts[0] not in ("..", "__pycache__"):
                top = dist.locate_file(f.parts[0])
                if os.path.exists(top):
                    paths[os.path.basename(top)] = os.path.realpath(top)
        for req in _requirements(dist):
            try:
                queue.append(metadata.distribution(req))
            except metadata.PackageNotFoundError:
                pass            # not installed here: the program's import says so
    return [paths[k] for k in sorted(paths)]


def readable_by_others(path: str) -> bool:
    """Whether a uid that is neither ``path``'s owner nor in its group (the sandbox's fresh uid) can reach
    and read it: every ancestor searchable by others, the path itself readable (and searchable, a folder)."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    while folder != os.path.dirname(folder):
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return False
        folder = os.path.dirname(folder)
    mode = os.stat(path).st_mode
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & need == need


_COPIES: dict[tuple[str, int], str] = {}      # (source, its top-level mtime) → its copy
_copies_root: list[str] = []                  # the process's folder of copies, once made


def readable_copy(src: str) -> str:
    """A copy of ``src`` that other users can read (folders 0755, files 0644 or 0755), in a folder of this
    process's removed at exit; made once per source and top-level mtime."""
    src = os.path.realpath(src)
    key = (src, os.stat(src).st_mtime_ns)
    if key not in _COPIES:
        if not _copies_root:
            _copies_root.append(tempfile.mkdtemp(prefix="arbor-sandbox-copies-"))
            os.chmod(_copies_root[0], 0o755)
            atexit.register(shutil.rmtree, _copies_root[0], True)
        dest = os.path.join(_copies_root[0], str(len(_COPIES)), os.path.basename(src))
        os.makedirs(os.path.dirname(dest))
        if os.path.isdir(src):
            shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest)
        for folder, _, names in os.walk(os.path.dirname(dest)):    # this copy only
            os.chmod(folder, 0o755)
            for name in names:
                f = os.path.join(folder, name)
                if not os.path.islink(f):
                    os.chmod(f, 0o755 if os.stat(f).st_mode & stat.S_IXUSR else 0o644)
        _COPIES[key] = dest
    return _COPIES[key]


def check_files(files: dict) -> None:
    """``SandboxConfig.files``: {absolute path in the sandbox: existing host path}, away from the view's own."""
    for dest, src in files.items():
        where = f"sandbox.files[{dest!r}]"
        if not isinstance(dest, str) or not os.path.isabs(dest) or os.path.normpath(dest) != dest or dest == "/":
            raise ValueError(f"{where}: the path in the sandbox must be absolute and normalised, e.g. '/data/repo'")
        if any(dest == r or dest.startswith(r + "/") for r in _RESERVED) or dest in ("/tmp", WORKDIR, "/opt"):
            raise ValueError(f"{where}: {dest} is part of the sandbox's own view; choose another place, e.g. /data/…")
        if not isinstance(src, str) or not os.path.exists(src):
            raise ValueError(f"{where}: host path {src!r} does not exist")


def view(py: Interpreter, packages, files: dict, tmp_mb: int, main_py: str,
         other_uid: bool = False) -> tuple[list[tuple], dict[str, str]]:
    """(the mount operations, the environment) of a run; see the module docstring. ``other_uid``: the
    program runs as a uid other than this process's (packages and files it cannot read are copied)."""
    check_files(files)

    def source(path: str) -> str:
        return readable_copy(path) if other_uid and not readable_by_others(path) else os.path.realpath(path)
    ops = _libraries()
    interp, env = _interpreter(py)
    ops += interp
    pkgs = package_sources(packages) if packages else []
    ops += [("bind", source(p), f"{PACKAGES_ROOT}/{os.path.basename(p)}") for p in pkgs]
    if pkgs:
        env["PYTHONPATH"] = PACKAGES_ROOT
    ops += [("bind", source(src), dest) for dest, src in sorted(files.items())]
    size = tmp_mb << 20
    ops += [("proc", "/proc"), ("dev", "/dev"), ("tmpfs", "/tmp", size), ("tmpfs", "/var/tmp", size),
            ("tmpfs", "/dev/shm", size), ("dir", WORKDIR), ("file", main_py, f"{WORKDIR}/main.py"),
            ("remount-ro", "/dev"), ("remount-ro", "/")]
    return ops, env


def bwrap_argv(ops: list[tuple], env: dict[str, str], with_proc: bool = True) -> tuple[list[str], list[int]]:
    """bwrap's arguments for ``ops`` (up to the command) and the fds it reads (``--file``), opened here:
    the caller passes them to the child and closes them after. Without ``with_proc`` /proc is left empty
    (a container whose /proc is partly masked refuses a new procfs to an unprivileged user)."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--hostname", "sandbox", "--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    fds = []
    for op in ops:
        kind = op[0]
        if kind == "bind":
            argv += ["--ro-bind", op[1], op[2]]
        elif kind == "tmpfs":
            argv += (["--size", str(op[2])] if op[2] else []) + ["--tmpfs", op[1]]
        elif kind == "proc":
            argv += ["--proc", op[1]] if with_proc else ["--dir", op[1]]
        elif kind == "file":
            fds.append(os.open(op[1], os.O_RDONLY | os.O_CLOEXEC))
            argv += ["--file", str(fds[-1]), op[2]]
        else:               # symlink, remount-ro, dev, dir: bwrap's options of the same name
            argv += [f"--{kind}", *op[1:]]
    return argv + ["--chdir", WORKDIR], fds
