"""``arbor train cluster=ray``: the driver that places the actors, runs the loop and cleans up.

``ClusterRun(cfg).start()`` connects to Ray (``ray_env``), creates the placement groups
(``placement``), the replica manager with ``cluster.engines`` engine replicas, and ``cluster.trainers``
trainer-rank actors that form one torch.distributed group; ``launch()`` starts every rank's
training and ``wait()`` (which launches if needed) returns rank 0's metric rows; ``close()`` kills
every actor, removes the groups and, for a cluster it started, ends Ray. ``train(cfg)`` does it all.

Failures: a replica that dies is the engine clients' and the manager's business (the run goes on).
A trainer rank that dies, or fails, stops the run: the driver kills the other ranks and raises
``ClusterError`` naming the rank, where it ran and why, with the step reached and how to resume
(the same command again continues from ``OUT/checkpoint``); an error raised by the training code
itself (a bad setting, a refused checkpoint) is re-raised as it is.

Files: ``OUT/metrics.jsonl``, ``OUT/checkpoint``, ``OUT/final`` as in one process, plus
``OUT/cluster.json`` (the cluster section, where each actor ran, replica replacements, each replica's
engine steps with their wall and CPU seconds at the end) and, for a
local cluster, Ray's session files under ``OUT/ray``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from arbor.cluster import placement, ray_env
from arbor.cluster.config import ClusterRLConfig, plain_rl_config
from arbor.cluster.manager import ReplicaManager, actor_options
from arbor.cluster.remote_engine import ClusterError
from arbor.cluster.replica import ReplicaSpec
from arbor.cluster.trainer_rank import TrainerRank
from arbor.train.config import engine_config


def replica_spec(rl, c) -> ReplicaSpec:
    """The engine of every replica: the RL run's ``engine_config`` (as in one process)."""
    return ReplicaSpec(rl.model, dataclasses.asdict(engine_config(rl)), 1, c.stream_interval_ms / 1e3)


class ClusterRun:
    def __init__(self, cfg: ClusterRLConfig):
        self.cfg, self.c, self.rl = cfg, cfg.cluster, plain_rl_config(cfg)
        self.out = Path(self.rl.out)
        self.started, self.layout, self.manager, self.trainers, self.info, self.refs = False, None, None, [], {}, {}

    def start(self) -> "ClusterRun":
        import ray

        c = self.c
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = ray_env.start(c, self.out)
        self.layout = placement.place(c)
        spec = replica_spec(self.rl, c)
        spec.threads = placement.threads_for(self.layout.engines[0], c.threads)
        self.manager = ray.remote(ReplicaManager).options(num_cpus=0).remote(
            spec, self.layout.engines, c.max_replacements, c.start_timeout_s)
        replicas_up = self.manager.start.remote()
        actor = ray.remote(TrainerRank)               # their processes start while the replicas load
        self.trainers = [actor.options(max_concurrency=2, **actor_options(b)).remote(i, c.trainers)
                         for i, b in enumerate(self.layout.trainers)]
        master = ray.get(self.trainers[0].address.remote(), timeout=c.start_timeout_s)
        table = ray.get(replicas_up, timeout=c.start_timeout_s + 10)
        ranks = ray.get([t.setup.remote(self.rl, self.manager, master, placement.threads_for(b, c.threads), c.weight_sync)
                         for t, b in zip(self.trainers, self.layout.trainers)], timeout=c.start_timeout_s)
        if c.weight_sync == "broadcast":
            ray.get(self.manager.set_source.remote(self.trainers[0]))
        replicas = ray.get([h.info.remote() for _, h in table])
        where = lambda bs: [{"group": self.layout.groups.index(b.pg), "bundle": b.index, "cpus": b.cpus, "gpus": b.gpus}
                            for b in bs]
        self.info = {"cluster": dataclasses.asdict(c), "trainers": ranks, "replicas": replicas,
                     "placement": {"groups": len(self.layout.groups), "trainers": where(self.layout.trainers),
                                   "engines": where(self.layout.engines)},
                     "engine_threads": spec.threads,
                     "ray_temp_dir": str(Path(c.temp_dir or self.out / "ray").resolve()) if self.started and not c.address
                     else None}
        self._write_info()
        return self

    def _write_info(self) -> None:
        (self.out / "cluster.json").write_text(json.dumps(self.info, indent=2, default=str))

    def launch(self) -> "ClusterRun":
        """Start every rank's training (returns at once; ``wait`` collects it)."""
        self.refs = {t.run.remote(): rank for rank, t in enumerate(self.trainers)}
        return self

    def wait(self) -> list[dict]:
        """Run every rank to ``steps`` (``launch`` first unless done); → rank 0's rows (rank 0 shows
        and logs its progress itself, as in one process). Raises ``ClusterError`` when a rank dies."""
        import ray
        if not self.refs:
            self.launch()
        refs = self.refs
        pending, history, last = list(refs), [], None
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=2.0)
            last = self._progress(last)
            for ref in done:
                try:
                    rows = ray.get(ref)
                except Exception as e:                # noqa: BLE001 (turned into the run's error)
                    self._fail(refs, ref, e, pending, last)
                if refs[ref] == 0:
                    history = rows
        self.info["manager"] = ray.get(self.manager.stats.remote())
        self.info["resubmitted"] = (last or {}).get("resubmitted", 0)
        self.info["replicas_at_end"] = self.replica_info()
        self._write_info()
        return history

    def replica_info(self) -> list[dict]:
        """``EngineReplica.info`` of every replica now serving (its calls, and its engine steps: count,
        wall and CPU seconds, see ``StepMeter``); a replica that cannot answer is left out."""
        import ray
        refs = [h.info.remote() for _, h in ray.get(self.manager.table.remote())]
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=10))
            except Exception:                         # noqa: BLE001 (dead or stuck: being replaced)
                pass
        return out

    def _progress(self, last):
        """Rank 0's progress (steps, last row, re-submitted requests), or ``last`` when it cannot answer."""
        import ray
        try:
            return ray.get(self.trainers[0].progress.remote(), timeout=5)
        except Exception:                             # noqa: BLE001 (rank 0 gone: reported by wait)
            return last

    def _fail(self, refs: dict, ref, error: BaseException, pending: list, last) -> None:
        """Raise the run's error: a death (preferred: it is the cause of the others' collective
        errors), else the training code's own exception."""
        import ray
        import ray.exceptions as rex
        errors = {refs[ref]: error}
        if pending and not isinstance(error, rex.RayActorError):    # a peer's death may be the cause
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=min(5.0, self.rl.dist.timeout_s))
            for r in done:
                try:
                    ray.get(r)
                except Exception as e:                # noqa: BLE001
                    errors[refs[r]] = e
        dead = {k: e for k, e in errors.items() if isinstance(e, rex.RayActorError)}
        if not dead:
            rank, e = min(errors.items())
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, BaseException) else e)
        rank, e = min(dead.items())
        where = self.info.get("trainers", [{}] * (rank + 1))[rank]
        step = (last or {}).get("steps", 0)
        every = self.rl.checkpoint_every
        resume = (f"run the same command again: it resumes from {self.out / 'checkpoint'} (written every "
                  f"{every} steps)" if every else "no checkpoint is written (checkpoint_every=0): a new run starts over")
        reason = str(e).strip().splitlines()
        raise ClusterError(f"trainer rank {rank} of {self.c.trainers} (pid {where.get('pid')}, node {where.get('node')}) "
                           f"died: {reason[0] if reason else type(e).__name__}; the run stopped after {step} step(s) of "
                           f"this call; {resume}") from e

    def close(self) -> None:
        import ray
        if not ray.is_initialized():
            return
        handles = list(self.trainers)
        if self.manager is not None:
            try:
                handles += [h for _, h in ray.get(self.manager.table.remote(), timeout=10)]
            except Exception:                         # noqa: BLE001 (its replicas go with it)
                pass
            handles.append(self.manager)
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:                         # noqa: BLE001 (already gone)
                pass
        for pg in (self.layout.groups if self.layout else []):
            placement.ray_remove(pg)
        ray_env.stop(self.started)


def train(cfg: ClusterRLConfig) -> list[dict]:
    """``arbor train cluster=ray``: start, run to ``steps``, clean up. → rank 0's metric rows."""
    run = ClusterRun(cfg)
    try:
        run.start()
        return run.wait()
    finally:
        run.close()
