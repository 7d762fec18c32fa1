"""The one trainer loop: SFT, masked-diffusion SFT, TAD, RL and EBPO all run through ``run_loop``.

A trainer (``Trainer``) does one training step per ``train_step()`` (its own forward, backward and
optimizer step(s)) and returns that step's metric row; the loop owns everything around the steps:

1. resume (unless ``resume=False``): with a ``checkpoint`` folder that holds a checkpoint of the same settings, the trainer
   is restored from it (``arbor.train.checkpoint.load_trainer``); ``run_log.start`` then opens the
   logs at the step resumed from;
2. per step: ``train_step()`` (awaited when it returns an awaitable); every ``eval_every`` steps
   ``eval_row()`` joins the row; ``until(step)`` may end training after this step (on several ranks
   every rank stops when one asks); every ``log_every`` steps, after the last and at a stop, the row
   goes to ``run_log`` (``OUT/metrics.jsonl``, TensorBoard, …), to ``trainer.history`` and, on the
   main rank, to ``on_row``;
3. a checkpoint every ``checkpoint_every`` steps and after the last (``save_trainer``: crash-safe).

Invariant: a run stopped anywhere (even killed mid-checkpoint) and started again with the same
config ends with the same weights and history, bit for bit, as one that never stopped
(tests/test_train_resume.py, tests/test_rl_loop.py, tests/test_cli_determinism.py).

``BatchTrainer`` is the trainer of the supervised jobs (SFT, masked-diffusion SFT, TAD): a batch
function ``step_fn(rng)`` plus one AdamW step; ``RLTrainer`` and ``EBPOTrainer`` are the RL ones.
"""

from __future__ import annotations

import inspect
import random
from pathlib import Path
from typing import Awaitable, Callable, Protocol

from arbor.distributed import DistContext
from arbor.train.checkpoint import load_trainer, save_trainer, settings_of
from arbor.train.optim import make_optimizer, optimizer_step


class Trainer(Protocol):
    """What ``run_loop`` drives (``model``, ``optimizer``, ``tok`` and ``settings`` are what its
    checkpoints hold; ``tok`` may be None)."""
    step: int                     # steps done = the index of the next step
    history: list[dict]           # the rows logged so far (part of every checkpoint)
    ctx: DistContext
    model: object
    optimizer: object
    tok: object
    settings: dict                # what a checkpoint must match to be resumed (``settings_of``)

    def train_step(self) -> dict | Awaitable[dict]:
        """Run step ``self.step`` and count it; → its row (``{"step": index, metric: value, …}``)."""

    def state_dict(self) -> dict:
        """The trainer's own state for a checkpoint (beyond model, optimizer, torch RNGs, step, history)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state (model and optimizer are loaded already)."""


async def run_loop(trainer: Trainer, steps: int, *, checkpoint: Path | None = None, checkpoint_every: int = 0,
                   resume: bool = True, log_every: int = 1, eval_every: int = 0, run_log=None, on_row=None,
                   until: Callable[[int], bool] | None = None) -> list[dict]:
    """Train ``trainer`` to ``steps`` steps (module docstring); → ``trainer.history``.

    ``checkpoint`` None: nothing is resumed or written; ``resume=False``: nothing is resumed. ``eval_every`` needs ``trainer.eval_row()``
    (a row's extra metrics; may be async)."""
    ctx = trainer.ctx
    if checkpoint is not None and resume:
        load_trainer(checkpoint, trainer)
    if run_log is not None:
        run_log.start(trainer.step)
    while trainer.step < steps:
        row = await _result(trainer.train_step())
        done = trainer.step
        if eval_every and done % eval_every == 0:
            row.update(await _result(trainer.eval_row()))
        stop = until is not None and until(done - 1)
        if until is not None and ctx.distributed:        # every rank stops at the same step
            stop = bool(ctx.flags_max(float(stop), name="early stop")[0])
        if (done - 1) % log_every == 0 or done == steps or stop:
            if run_log is not None:
                row = run_log.log(row)
            trainer.history.append(row)
            if on_row and ctx.is_main:
                on_row(row)
        if checkpoint is not None and checkpoint_every and (done % checkpoint_every == 0 or done == steps):
            save_trainer(checkpoint, trainer)
        if stop:
            break
    if run_log is not None:
        run_log.close()
    return trainer.history


async def _result(value):
    return await value if inspect.isawaitable(value) else value


def run_sync(coroutine):
    """Run a coroutine that never suspends (``run_loop`` of a trainer whose steps are plain calls)
    to its result without an event loop, so that a callback inside it (``until``) may run one."""
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value
    coroutine.close()
    raise RuntimeError("run_sync: the coroutine suspended; run it with asyncio.run")


class BatchTrainer:
    """A loop trainer made of a batch function: each step ``step_fn(rng)`` draws a batch with ``rng``
    (a ``random.Random(cfg.seed)``, saved in checkpoints), runs forward and backward and returns the
    quantities to log; then ``optimizer_step`` clips and takes the scheduled AdamW step.

    ``cfg`` needs ``steps``, ``seed``, ``log_every``, ``checkpoint_every`` (0: never) and ``optim``.
    ``settings`` (default ``settings_of(cfg)``) is what a checkpoint must match: callers pass the
    whole run's (model, data, …). ``ctx``: the ranks of a multi-rank run (gradients summed over
    ranks before each optimizer step)."""
    tok = None

    def __init__(self, model, cfg, step_fn, settings: dict | None = None, ctx: DistContext | None = None):
        self.model, self.cfg, self.step_fn = model, cfg, step_fn
        self.ctx = ctx or DistContext.single()
        self.optimizer = make_optimizer(model, cfg.optim)
        self.settings = settings_of(cfg) if settings is None else settings
        self.rng = random.Random(cfg.seed)
        self.step, self.history = 0, []

    def train_step(self) -> dict:
        logged = self.step_fn(self.rng)
        stats = optimizer_step(self.model, self.optimizer, self.step, self.cfg.steps, self.cfg.optim, self.ctx)
        row = {"step": self.step, **{k: float(v) for k, v in logged.items()}, **stats}
        self.step += 1
        return row

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])

    def run(self, on_log=None, until=None, checkpoint_dir=None, run_log=None) -> list[dict]:
        """Train in place for ``cfg.steps`` steps, or until ``until(step)`` (asked after each step)
        says stop, resuming from ``checkpoint_dir`` (None: no checkpoints); → the logged rows."""
        self.model.train()
        history = run_sync(run_loop(self, self.cfg.steps, checkpoint=checkpoint_dir, checkpoint_every=self.cfg.checkpoint_every,
                                    log_every=self.cfg.log_every, run_log=run_log, on_row=on_log, until=until))
        self.model.eval()
        return history
