"""Starting or joining Ray for a run, with the run's files and settings.

Invariants of a cluster this module starts (``cluster.address=""``): usage statistics are off
(``RAY_USAGE_STATS_ENABLED=0``), Ray writes no auth token under the home folder
(``RAY_AUTH_MODE=disabled`` unless the caller set another mode), its session files and logs live
under the run's folder (``OUT/ray`` or ``cluster.temp_dir``), no dashboard runs, and ``stop`` ends
every process it started. Ray's Unix sockets must have paths under 108 bytes, so a deep run folder
is reached through a short symlink in the system's temp folder.

Joining (``cluster.address="auto"`` or ``HOST:PORT``) uses the cluster as it was started: its temp
folder and auth mode are its own. A process that already called ``ray.init`` (a test, a notebook) is
used as it is, and left running.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

MAX_TEMP_DIR_CHARS = 40     # + "/session_<date>_<time>_<us>_<pid>/sockets/plasma_store" stays < 108 bytes
_links: list[Path] = []     # symlinks made by short_temp_dir, removed by stop


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError("cluster.backend=ray needs Ray: pip install 'arbor[ray]' (ray>=2.9)") from e
    return ray


def short_temp_dir(folder: str | Path) -> str:
    """``folder`` (created, absolute), or a short symlink to it when its path is too long for Ray's sockets."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if len(str(folder)) <= MAX_TEMP_DIR_CHARS:
        return str(folder)
    link = Path(tempfile.gettempdir()) / f"arbor-ray-{hashlib.sha1(str(folder).encode()).hexdigest()[:12]}"
    if link.is_symlink() and Path(os.readlink(link)) != folder:
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(folder, target_is_directory=True)
    _links.append(link)
    return str(link)


def start(cluster, out: str | Path) -> bool:
    """Connect this process to Ray as ``cluster`` (a ``ClusterConfig``) says; → True when this call
    started or joined Ray (so ``stop`` should disconnect), False when Ray was already initialised."""
    ray = import_ray()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if ray.is_initialized():
        return False
    if cluster.address:
        ray.init(address=cluster.address, log_to_driver=True)
        return True
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kw = {}
    if cluster.object_store_mb:
        kw["object_store_memory"] = cluster.object_store_mb << 20
    ray.init(num_cpus=cluster.num_cpus or os.cpu_count() or 1, include_dashboard=False, log_to_driver=True,
             _temp_dir=short_temp_dir(cluster.temp_dir or Path(out) / "ray"), **kw)
    return True


def stop(started: bool) -> None:
    """Disconnect (and, for a local cluster, end it) when ``start`` returned True; remove the symlinks."""
    if started:
        import ray
        ray.shutdown()
    while _links:
        link = _links.pop()
        if link.is_symlink():
            link.unlink()
