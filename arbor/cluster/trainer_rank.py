"""A trainer rank: one Ray actor running the ordinary ``RLTrainer`` against a ``RemoteEngine``.

The driver creates ``trainers`` of these, asks rank 0 for an address (``address``), then calls
``setup`` on all of them at once: each sets torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK=0`` — Ray shows an actor only its own GPUs) and joins
the trainer group through ``arbor.distributed.init_distributed``, so data and expert parallelism, the loss
normalisation over ranks, rank 0's logging and the per-rank checkpoints are exactly those of
``arbor launch -n M train``. ``run`` then trains to ``steps`` (resuming from ``OUT/checkpoint``), plots
and saves ``OUT/final`` as ``arbor train`` does.

The actor is threaded (two calls at once) so that, while ``run`` trains, the driver can read
``progress`` and the replica manager can fetch rank 0's last synced weights (``weights_ref``).
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import torch


class TrainerRank:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.trainer = self.engine = None

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): the trainer group's MASTER_ADDR and MASTER_PORT."""
        import ray
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, cfg, manager, master: tuple[str, int], threads: int, weight_sync: str) -> dict:
        """Join the trainer group and build model, remote engine and trainer. → where this rank runs."""
        import ray

        from arbor.cluster.remote_engine import RemoteEngine
        from arbor.distributed import init_distributed
        from arbor.models import ModelConfig, load_model
        from arbor.models.tokenizer import Tokenizer
        from arbor.train.rl import RLTrainer
        from arbor.train.run import print_notes, rl_task, sampling_factory
        torch.set_num_threads(max(1, threads))
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          LOCAL_WORLD_SIZE="1", MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        torch.manual_seed(cfg.seed)
        ctx = init_distributed(cfg.dist, ModelConfig.from_file(cfg.model).num_experts, cfg.device)
        model = load_model(cfg.model, dtype=torch.float32, device=cfg.device, ctx=ctx)
        tok = Tokenizer.load(cfg.model)
        self.engine = RemoteEngine(manager, ctx, model, weight_sync, cfg.dist.timeout_s)
        task = rl_task(cfg, tok)
        print_notes(task, ctx)
        self.trainer = RLTrainer(cfg, model, tok, self.engine, sampling_factory(tok, bool(model.config.moe_layers)),
                                 task, ctx)
        self.cfg = cfg
        return {"rank": self.rank, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "threads": torch.get_num_threads()}

    def run(self) -> list[dict]:
        """Train to ``cfg.steps``; rank 0 plots; every rank joins the final save. → rank 0's rows."""
        from arbor.train.checkpoint import save_trainer
        from arbor.train.run import plot_history
        history = asyncio.run(self.trainer.run())
        out = Path(self.cfg.out)
        if self.trainer.ctx.is_main:
            plot_history(history, out / "reward.png", f"{self.trainer.task.name} RL (Ray)")
        save_trainer(out / "final", self.trainer)
        return history if self.trainer.ctx.is_main else []

    def progress(self) -> dict:
        """Steps done so far, the last row, and how many requests the remote engine re-submitted."""
        t = self.trainer
        if t is None:
            return {"steps": 0, "row": None, "resubmitted": 0}
        return {"steps": len(t.history), "row": t.history[-1] if t.history else None, "step": t.step,
                "resubmitted": self.engine.resubmitted}

    def weights_ref(self):
        return self.engine.weights_ref()
