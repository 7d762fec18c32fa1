"""The program a sandbox run starts with (``python -s -c PRELUDE``), before the user's ``main.py``.

With ``private SIZE_MB NAME`` arguments (OS isolation) it first mounts private tmpfs on /tmp, /var/tmp
and /dev/shm, moves into /tmp/NAME and drops every capability (``_private``). Always: ``socket`` and
``_socket`` constructors and resolvers raise PermissionError, '' leaves sys.path, and ``main.py`` runs
as ``__main__`` with the traceback's own frame hidden; a MemoryError exits with status "MemoryError".
"""

PRIVATE = r'''
def _private(size_mb, name):
    """Private tmpfs on the shared temporary folders, cwd inside, then no capability left."""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    for target in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(target) and libc.mount(b"tmpfs", target.encode(), b"tmpfs", 2 | 4,   # nosuid, nodev
                                                f"size={size_mb}m,mode=1777".encode()) != 0:
            raise OSError(ctypes.get_errno(), "sandbox: cannot mount a private " + target)
    os.mkdir("/tmp/" + name, 0o700)
    os.chdir("/tmp/" + name)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)                    # PR_CAPBSET_DROP (EINVAL past the last one)
    libc.prctl(47, 4, 0, 0, 0)                          # PR_CAP_AMBIENT_CLEAR_ALL
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    if libc.prctl(38, 1, 0, 0, 0) or libc.capset(ctypes.byref(Header(0x20080522, 0)), (ctypes.c_uint32 * 6)()):
        raise OSError(ctypes.get_errno(), "sandbox: cannot drop capabilities")
'''
PRELUDE = PRIVATE + r'''
import socket as _sm, _socket as _cs, sys, traceback
if sys.argv[1:2] == ["private"]:
    with open("main.py", "rb") as _f:
        _src = _f.read()
    _private(int(sys.argv[2]), sys.argv[3])
    with open("main.py", "wb") as _f:
        _f.write(_src)
    del _src, _f, _private
def _no_network(*args, **kwargs):
    raise PermissionError("network disabled in sandbox")
class _NoSocket(_sm.socket):
    __init__ = _no_network
for _m in (_sm, _cs):
    _m.socket = _m.SocketType = _NoSocket
    for _n in {"socketpair", "fromfd", "fromshare", "create_connection", "create_server", "getaddrinfo",
               "gethostbyname", "gethostbyname_ex", "gethostbyaddr"} & set(dir(_m)):
        setattr(_m, _n, _no_network)
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
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
'''
