"""The programs a sandbox run executes before the user's ``main.py``.

``PRELUDE`` (``python -s -c PRELUDE``, in the run's working directory): ``_socket``'s constructors and
resolvers raise PermissionError before anything imports ``socket``, whose classes and functions call
them (importing ``socket`` here would cost 5 ms a run), '' leaves sys.path, and ``main.py`` runs as
``__main__`` with the traceback's own frame hidden; a MemoryError exits with status "MemoryError".

``STAGE`` (the ``unshare`` fallback's first stage, ``python -I -S -c STAGE SPEC``, as root of fresh user,
mount, network, PID, IPC and UTS namespaces): builds the view of `arbor.rollout.sandbox_view` in a tmpfs
with mount(2), pivots into it (pivot_root(".", ".") and a lazy unmount of the old root), drops every
capability (bounding set, ambient, effective/permitted/inheritable; no new privileges) and execs
SPEC's argv. Only the top mount of a bind is made read-only (bwrap does it recursively); a procfs the
kernel refuses (a container's partly masked /proc) leaves /proc empty, as bwrap's fallback does.
"""

STAGE = r'''
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
def fail(what):
    e = ctypes.get_errno()
    raise OSError(e, f"sandbox: {what}: {os.strerror(e)}")
def mount(src, dst, fs, flags, data=None):
    if libc.mount(src and src.encode(), dst.encode(), fs and fs.encode(), flags, data and data.encode()):
        fail(f"mount {src or fs} on {dst}")
def readonly(path):     # keep the flags a user namespace may not clear (statvfs's ST_* are MS_*, but relatime)
    f = os.statvfs(path).f_flag
    mount(None, path, None, REMOUNT | BIND | RDONLY | (f & (NOSUID | NODEV | NOEXEC | 1024 | 2048)) | ((1 << 21) if f & 4096 else 0))
src = {i: os.open(op[1], os.O_PATH) for i, op in enumerate(spec["ops"]) if op[0] in ("bind", "file")}
R = "/tmp"              # the new root: its tmpfs hides the host's /tmp, so sources are opened first
mount(None, "/", None, REC | PRIVATE)
mount("tmpfs", R, "tmpfs", NOSUID | NODEV, "size=1m,mode=0755")
for i, (kind, *a) in enumerate(spec["ops"]):
    t = R + a[-1] if kind in ("bind", "symlink", "file") else R + a[0]
    if kind == "bind":
        if os.path.isdir(f"/proc/self/fd/{src[i]}"):
            os.makedirs(t, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(t), exist_ok=True)
            open(t, "a").close()
        mount(f"/proc/self/fd/{src[i]}", t, None, BIND | REC)
        readonly(t)
    elif kind == "symlink":
        os.makedirs(os.path.dirname(t), exist_ok=True)
        os.symlink(a[0], t)
    elif kind == "tmpfs":
        os.makedirs(t, exist_ok=True)
        mount("tmpfs", t, "tmpfs", NOSUID | NODEV, "mode=1777" + (f",size={a[1]}" if a[1] else ""))
    elif kind == "remount-ro":
        readonly(t)
    elif kind == "proc":
        os.makedirs(t, exist_ok=True)
        try:
            mount("proc", t, "proc", NOSUID | NODEV | NOEXEC)
        except OSError:
            pass
    elif kind == "dev":
        os.makedirs(t)
        mount("tmpfs", t, "tmpfs", NOSUID, "size=64k,mode=0755")
        for n in ("null", "zero", "full", "random", "urandom", "tty"):
            if os.path.exists("/dev/" + n):
                open(f"{t}/{n}", "a").close()
                mount("/dev/" + n, f"{t}/{n}", None, BIND)
        for n, fd in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
            os.symlink("/proc/self/fd" + fd, f"{t}/{n}")
        os.mkdir(t + "/shm")
    elif kind == "dir":
        os.makedirs(t, exist_ok=True)
    elif kind == "file":
        with open(f"/proc/self/fd/{src[i]}", "rb") as f, open(t, "wb") as g:
            g.write(f.read())
for fd in src.values():
    os.close(fd)
os.chdir(R)
if libc.syscall({"x86_64": 155, "aarch64": 41}[os.uname().machine], b".", b"."):
    fail("pivot_root")
if libc.umount2(b".", 2):                                       # MNT_DETACH: the old root goes
    fail("unmount the host's root")
os.chdir(spec["cwd"])
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)                                # PR_CAPBSET_DROP (EINVAL past the last one)
libc.prctl(47, 4, 0, 0, 0)                                      # PR_CAP_AMBIENT_CLEAR_ALL
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
if libc.prctl(38, 1, 0, 0, 0) or libc.capset(ctypes.byref(Header(0x20080522, 0)), (ctypes.c_uint32 * 6)()):
    fail("drop capabilities")
os.execve(spec["argv"][0], spec["argv"], spec["env"])
'''

PRELUDE = r'''
import _socket as _cs, sys
def _no_network(*args, **kwargs):
    raise PermissionError("network disabled in sandbox")
class _NoSocket(_cs.socket):
    __slots__ = ()          # socket.socket, its subclass, adds __weakref__
    __init__ = _no_network
_cs.socket = _cs.SocketType = _NoSocket
for _n in {"socketpair", "fromfd", "fromshare", "getaddrinfo", "gethostbyname", "gethostbyname_ex",
           "gethostbyaddr"} & set(dir(_cs)):
    setattr(_cs, _n, _no_network)
sys.path[:], sys.argv = [p for p in sys.path if p], ["main.py"]
_g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
try:
    with open("main.py", encoding="utf-8") as _f:
        exec(compile(_f.read(), "main.py", "exec"), _g)
except MemoryError:
    _g.clear()      # free what the program held before reporting
    sys.exit("MemoryError")
except BaseException as _e:
    if isinstance(_e, SystemExit):
        raise
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
'''
