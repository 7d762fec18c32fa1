"""Placement groups for trainer ranks and engine replicas (see ``arbor.cluster.config``).

Colocated: one group of ``trainers`` bundles {CPU: cpus_per_trainer, GPU: gpus_per_trainer}; replica j
joins bundle j mod trainers, and the actors of a bundle split it equally (rounded down to Ray's
granularity of 1e-4, so their requests always fit). Disaggregated: the same trainer group, and a
second group of ``engines`` bundles {CPU: cpus_per_engine, GPU: gpus_per_engine}, one per replica.
Both groups use the PACK strategy (fill a node before the next). A group that cannot be placed within
``start_timeout_s`` is an error naming what it asked for and what the cluster has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from arbor.cluster.manager import Bundle


@dataclass
class Layout:
    groups: list            # placement groups (removed at the end of the run)
    trainers: list[Bundle]  # per trainer rank
    engines: list[Bundle]   # per replica slot


def _bundle(cpus: float, gpus: float, who: str) -> dict:
    b = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    if not b:
        raise ValueError(f"cluster: a {who} bundle needs some CPU or GPU (cpus_per_{who} / gpus_per_{who} > 0)")
    return b


def _share(x: float, k: int) -> float:
    return math.floor(x / k * 1e4) / 1e4


def _ready(pg, bundles: list[dict], timeout_s: float) -> None:
    import ray
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
        have = {k: v for k, v in ray.cluster_resources().items() if k in need}
        raise ValueError(f"cluster: could not place {len(bundles)} bundles {bundles} within {timeout_s:g} s "
                         f"(they need {need}, the cluster has {have}); lower cluster.cpus_per_* / gpus_per_*, "
                         "or add nodes") from None


def place(c) -> Layout:
    """Create and wait for the placement groups of ``c`` (a ``ClusterConfig``)."""
    from ray.util import placement_group
    tb = [_bundle(c.cpus_per_trainer, c.gpus_per_trainer, "trainer")] * c.trainers
    tpg = placement_group(tb, strategy="PACK")
    _ready(tpg, tb, c.start_timeout_s)
    if c.colocate:
        per = [1 + sum(1 for j in range(c.engines) if j % c.trainers == i) for i in range(c.trainers)]
        trainers = [Bundle(tpg, i, _share(c.cpus_per_trainer, per[i]), _share(c.gpus_per_trainer, per[i]))
                    for i in range(c.trainers)]
        engines = [Bundle(tpg, j % c.trainers, trainers[j % c.trainers].cpus, trainers[j % c.trainers].gpus)
                   for j in range(c.engines)]
        return Layout([tpg], trainers, engines)
    eb = [_bundle(c.cpus_per_engine, c.gpus_per_engine, "engine")] * c.engines
    epg = placement_group(eb, strategy="PACK")
    try:
        _ready(epg, eb, c.start_timeout_s)
    except ValueError:
        ray_remove(tpg)
        raise
    trainers = [Bundle(tpg, i, c.cpus_per_trainer, c.gpus_per_trainer) for i in range(c.trainers)]
    engines = [Bundle(epg, j, c.cpus_per_engine, c.gpus_per_engine) for j in range(c.engines)]
    return Layout([tpg, epg], trainers, engines)


def threads_for(b: Bundle, configured: int) -> int:
    """Torch threads of an actor: ``cluster.threads``, else the whole CPUs it holds (at least 1)."""
    return configured or max(1, int(b.cpus))


def ray_remove(pg) -> None:
    import ray
    try:
        ray.util.remove_placement_group(pg)
    except Exception:                             # noqa: BLE001 (already gone with its cluster)
        pass
