"""The Arbor side of ``arbor bench e2e``, in a child process of its own, and the clock both sides share.

``python -m arbor.bench.e2e_worker --out DIR --seconds S --save-every E --threads T -- KEY=VALUE …``
builds the trainer of ``arbor train`` from the RL config's ``KEY=VALUE`` overrides (``arbor.train.run.
build_trainer``: model, colocated engine, task) and runs ``arbor train``'s loop (``arbor.train.loop.run_loop``)
until the training clock passes ``S`` seconds. The model is saved as an HF folder ``DIR/t{i}``
(``arbor.models.save_model``) when a step ends at or after the next save time (``TrainClock``: a
save at clock t sets it to max(t + E, t · (1 + ``--save-growth``))) and at the end.

``TrainClock`` is the clock of both systems (TRL's child, ``arbor.bench.rl_trl e2e``, uses it too):
it starts when the child's ``main`` starts (imports, model load and trainer set-up count, as they
do for a user) and stops while a snapshot is written, so the saves cost neither side anything.
``DIR/snapshots.json`` lists ``{"step", "train_s", "path"}`` per save: ``train_s`` is the clock at the
save, ``step`` the optimizer steps done. The RESULT line also gives where the time went: ``imports_s`` (clock
at the end of the imports), ``setup_s`` (… after ``build_trainer``), and per step ``step_end_s`` and the
step's ``rollout_s``, ``recompute_s``, ``train_s``, ``sync_s`` (``RLTrainer``'s row).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


PHASES = ("rollout_s", "recompute_s", "train_s", "sync_s")     # a step's parts (RLTrainer's row)


class TrainClock:
    """Elapsed seconds since ``start`` less the time spent in ``snapshot``. After a snapshot at clock t
    the next is due at max(t + ``every_s``, t · (1 + ``growth``)): the gap grows with the clock, so a
    time to a threshold is resolved to the same *fraction* of itself (``growth``) whether a run is fast
    or slow (a fixed gap would penalise the faster system, whose times are shorter), and a long run
    saves O(log seconds) models, not hundreds. A save is also due at ``mark`` (a run that goes on past
    the bench's horizon is saved at it, as a run that stops there is)."""

    def __init__(self, out: Path, seconds: float, every_s: float, start: float | None = None, growth: float = 0.0,
                 mark: float | None = None):
        self.out, self.seconds, self.every_s, self.growth, self.mark = Path(out), seconds, every_s, growth, mark
        self.start = time.perf_counter() if start is None else start
        self.paused = 0.0
        self.next_save = every_s if mark is None else min(every_s, mark)
        self.saves: list[dict] = []

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def done(self) -> bool:
        return self.now() >= self.seconds

    def due(self) -> bool:
        return self.now() >= self.next_save or self.done()

    def snapshot(self, step: int, save) -> None:
        """``save(folder)`` writes the model; its time is taken off the clock."""
        t = self.now()
        t0 = time.perf_counter()
        path = self.out / f"t{len(self.saves)}"
        save(path)
        self.saves.append({"step": step, "train_s": t, "path": str(path)})
        (self.out / "snapshots.json").write_text(json.dumps(self.saves, indent=1))
        self.next_save = max(t + self.every_s, t * (1 + self.growth))
        if self.mark is not None and t < self.mark:
            self.next_save = min(self.next_save, self.mark)
        self.paused += time.perf_counter() - t0


def add_clock_arguments(p) -> None:
    """The clock's flags, the same in both children (and ``arbor bench e2e``, which passes them on)."""
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--save-every", type=float, required=True)
    p.add_argument("--save-growth", type=float, default=0.0)
    p.add_argument("--save-at", type=float, default=None)


def clock_of(a, start: float) -> TrainClock:
    return TrainClock(Path(a.out), a.seconds, a.save_every, start, a.save_growth, a.save_at)


def main(argv=None) -> None:
    start = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m arbor.bench.e2e_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    add_clock_arguments(p)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="RL config KEY=VALUE (as `arbor train` takes them)")
    a = p.parse_args(argv)
    import asyncio

    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    from arbor import configs
    from arbor.models import save_model
    from arbor.train.config import RLConfig
    from arbor.train.loop import run_loop
    from arbor.train.run import build_trainer

    cfg = configs.load(RLConfig, None, a.overrides)
    cfg.validate()
    clock = clock_of(a, start)
    imports_s = clock.now()
    trainer = build_trainer(cfg)
    setup_s = clock.now()
    rows = []

    def on_row(row):
        rows.append({k: v for k, v in row.items() if isinstance(v, (int, float))} | {"clock_s": clock.now()})
        if clock.due():
            clock.snapshot(trainer.step, lambda path: save_model(trainer.model, path, tokenizer=trainer.tok))

    asyncio.run(run_loop(trainer, cfg.steps, on_row=on_row, until=lambda step: clock.done()))
    if not clock.saves or clock.saves[-1]["step"] != trainer.step:     # steps ran out before the clock
        clock.snapshot(trainer.step, lambda path: save_model(trainer.model, path, tokenizer=trainer.tok))
    print("RESULT " + json.dumps({"snapshots": clock.saves, "steps": trainer.step, "threads": torch.get_num_threads(),
                                  "step_end_s": [r["clock_s"] for r in rows],
                                  "samples_per_step": [r.get("samples") for r in rows],
                                  "train_reward": [r.get("reward") for r in rows], "imports_s": imports_s,
                                  "setup_s": setup_s, **{k: [r.get(k) for r in rows] for k in PHASES}}))


if __name__ == "__main__":
    main()
