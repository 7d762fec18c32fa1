"""``cluster.*`` keys of ``arbor train``: where the RL loop's actors run.

``ClusterRLConfig`` is ``RLConfig`` plus a ``cluster`` section; the RL keys mean exactly what they
mean in one process. ``cluster.backend=ray`` (on the command line also ``cluster=ray``) runs the loop
on Ray (``arbor.cluster.run``); ``none`` (the default) runs it in this process as before, and
``plain_rl_config`` strips the section so such a run's checkpoints are the usual ones.

Placement (``colocate``): colocated, trainer rank i holds one placement-group bundle of
``cpus_per_trainer`` CPUs and ``gpus_per_trainer`` GPUs, and the engine replicas j ≡ i (mod trainers)
share it with the rank (each actor of a bundle gets an equal fraction of it), as the single-process
loop shares one device between trainer and engine; disaggregated, the replicas have bundles of their
own (``cpus_per_engine`` / ``gpus_per_engine``) in a second placement group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from arbor.configs import check
from arbor.train.config import RLConfig

BACKENDS = ("none", "ray")
WEIGHT_SYNCS = ("store", "broadcast")


@dataclass
class ClusterConfig:
    backend: str = "none"          # none (this process) | ray
    address: str = ""              # "" starts a local Ray cluster; "auto" or "HOST:PORT" joins a running one
    engines: int = 2               # engine replicas (Ray actors, one AsyncLLMEngine each)
    trainers: int = 1              # trainer ranks (Ray actors forming one torch.distributed group)
    colocate: bool = True          # replicas share the trainer ranks' bundles (false: bundles of their own)
    cpus_per_trainer: float = 1.0
    gpus_per_trainer: float = 0.0
    cpus_per_engine: float = 1.0   # disaggregated only
    gpus_per_engine: float = 0.0   # disaggregated only
    threads: int = 0               # torch threads per actor (0: the whole CPUs its bundle share holds, at least 1)
    weight_sync: str = "store"     # store: Ray object store | broadcast: a gloo group of trainer rank 0 and the replicas
    stream_interval_ms: float = 50.0   # least time between two answers of a replica to a client's poll, unless a request finished (0: every step)
    num_cpus: int = 0              # a local cluster's CPUs (0: this machine's cores)
    object_store_mb: int = 0       # a local cluster's object store (0: Ray's default)
    temp_dir: str = ""             # Ray's session files of a local cluster ("": OUT/ray)
    max_replacements: int = 8      # replicas the run may replace after failures before it gives up
    start_timeout_s: float = 120.0  # placement groups and actors must be up within this

    def validate(self) -> None:
        check(self, (self.backend in BACKENDS, "backend", f"must be one of {BACKENDS}"),
              (self.engines >= 1, "engines", "must be ≥ 1"), (self.trainers >= 1, "trainers", "must be ≥ 1"),
              (self.cpus_per_trainer >= 0, "cpus_per_trainer", "must be ≥ 0"),
              (self.gpus_per_trainer >= 0, "gpus_per_trainer", "must be ≥ 0"),
              (self.cpus_per_engine >= 0, "cpus_per_engine", "must be ≥ 0"),
              (self.gpus_per_engine >= 0, "gpus_per_engine", "must be ≥ 0"),
              (self.threads >= 0, "threads", "must be ≥ 0"),
              (self.weight_sync in WEIGHT_SYNCS, "weight_sync", f"must be one of {WEIGHT_SYNCS}"),
              (self.stream_interval_ms >= 0, "stream_interval_ms", "must be ≥ 0"),
              (self.num_cpus >= 0, "num_cpus", "must be ≥ 0"), (self.object_store_mb >= 0, "object_store_mb", "must be ≥ 0"),
              (self.max_replacements >= 0, "max_replacements", "must be ≥ 0"),
              (self.start_timeout_s > 0, "start_timeout_s", "must be > 0"))


@dataclass
class ClusterRLConfig(RLConfig):
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> None:
        super().validate()
        if self.agent.fn and self.cluster.backend != "none":
            raise ValueError(f"agent={self.agent.fn!r} serves its episodes from this process's engine; it does not run "
                             f"on cluster.backend={self.cluster.backend} (leave cluster unset)")


def shorthand(overrides: list[str]) -> list[str]:
    """``cluster=ray`` → ``cluster.backend=ray`` (the section cannot also be a value)."""
    return [f"cluster.backend={w.split('=', 1)[1]}" if w.split("=", 1)[0].strip() == "cluster" else w
            for w in overrides]


def load_train_config(path, overrides: list[str]) -> ClusterRLConfig:
    from arbor import configs
    return configs.load(ClusterRLConfig, path, shorthand(list(overrides)))


def plain_rl_config(cfg: ClusterRLConfig) -> RLConfig:
    """The RL part alone (what every trainer rank runs, and what a checkpoint's settings record)."""
    return RLConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(RLConfig)})
