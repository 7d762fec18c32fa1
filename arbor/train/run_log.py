"""One run logger for every job: ``OUT/metrics.jsonl``, TensorBoard, Weights & Biases, a progress bar.

Invariants:
- ``metrics.jsonl`` holds one JSON object per logged step, in step order, each with ``step`` and
  ``seconds`` (wall time since the previous row, or since the logger opened). Opening a log at
  ``start_step`` drops every row of a step ≥ ``start_step`` first (of ``samples.jsonl`` too), so a
  resumed run never leaves a step twice and a fresh run (start 0) starts fresh files.
- ``OUT/run_config.json`` is the run's config, written when the log opens (the same on a resume; not
  ``config.json``, which an HF model folder written to OUT holds).
- TensorBoard (``OUT/tb``) gets every numeric value when ``torch.utils.tensorboard`` imports;
  W&B gets them with ``log.wandb=true`` (``WANDB_MODE=offline`` is set when no API key is present,
  so it works without a network); the console shows a tqdm bar with ``log.bar_keys`` and the ETA.
- A row's ``samples_table`` (a list of ``{"prompt", "completion", "reward"}``: held-out samples) is
  not a metric: it goes to ``OUT/samples.jsonl`` (one line per step), TensorBoard text and a W&B table.
- On a rank other than 0 (``enabled=False``) nothing is written or shown.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LogConfig:
    """The ``log`` section of every job."""
    tensorboard: bool = True         # OUT/tb when tensorboard is installed
    wandb: bool = False              # Weights & Biases (offline unless WANDB_API_KEY is set)
    wandb_project: str = "arbor"
    progress: bool = True            # console progress bar with the key metrics and ETA
    bar_keys: list[str] = field(default_factory=lambda: ["loss", "reward", "grad_norm", "masked_frac"])


class RunLog:
    """Created with the run's facts; ``start(step)`` opens the sinks once the first step to run is
    known (after a checkpoint was or was not resumed)."""

    def __init__(self, out, cfg=None, total_steps: int = 0, log: LogConfig | None = None, enabled: bool = True,
                 name: str = "run"):
        self.out, self.cfg, self.total, self.log_cfg = Path(out), cfg, total_steps, log or LogConfig()
        self.enabled, self.name = enabled, name
        self.bar = self.tb = self.wandb = self.file = None
        self.last = time.perf_counter()

    def start(self, start_step: int = 0) -> "RunLog":
        self.last = time.perf_counter()
        if not self.enabled or self.file is not None:
            return self
        cfg, name, total_steps = self.cfg, self.name, self.total
        self.out.mkdir(parents=True, exist_ok=True)
        if cfg is not None:
            data = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg
            (self.out / "run_config.json").write_text(json.dumps(data, indent=2, default=str))
        self.path = self.out / "metrics.jsonl"
        self.path.touch()
        for path in (self.path, self.out / "samples.jsonl"):      # a step is never logged twice
            if path.exists():
                lines = path.read_text().splitlines() if start_step > 0 else []
                path.write_text("".join(line + "\n" for line in lines if line and json.loads(line)["step"] < start_step))
        self.file = self.path.open("a")
        if self.log_cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.out / "tb"))
            except ImportError:
                pass
        if self.log_cfg.wandb:
            self.wandb = _wandb_run(self.out, self.log_cfg, cfg, name)
        if self.log_cfg.progress and total_steps:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc=name, dynamic_ncols=True)
            if start_step:
                self.bar.write(f"{name}: resumed from step {start_step}")
        return self

    def log(self, row: dict) -> dict:
        """Append one step's row (adds ``seconds``); → the row as written."""
        now = time.perf_counter()
        row = {**row, "seconds": row.get("seconds", now - self.last)}
        table = row.pop("samples_table", None)
        if table and self.enabled and self.file is not None:
            self._table(row["step"], table)
        self.last = now
        if not self.enabled or self.file is None:
            return row
        self.file.write(json.dumps(row, default=float) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k != "step" and math.isfinite(v)}
        if self.tb is not None:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(numbers, step=row["step"])
        if self.bar is not None:
            self.bar.n = row["step"] + 1
            self.bar.set_postfix({k: f"{numbers[k]:.4g}" for k in self.log_cfg.bar_keys if k in numbers}, refresh=False)
            self.bar.refresh()
        return row

    def _table(self, step: int, table: list[dict]) -> None:
        with (self.out / "samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "samples": table}, default=str) + "\n")
        if self.tb is not None:
            lines = ["| prompt | completion | reward |", "| --- | --- | --- |"]
            lines += [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']:.3g} |" for r in table]
            self.tb.add_text("eval/samples", "\n".join(lines), step)
        if self.wandb is not None:
            import wandb
            self.wandb.log({"eval/samples": wandb.Table(columns=["prompt", "completion", "reward"],
                                                        data=[[r["prompt"], r["completion"], r["reward"]] for r in table])},
                           step=step)

    def close(self) -> None:
        if self.file is None:
            return
        self.file.close()
        self.file = None
        for sink in (self.bar, self.tb):
            if sink is not None:
                sink.close()
        if self.wandb is not None:
            self.wandb.finish()


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")[:400]


def _wandb_run(out: Path, log: LogConfig, cfg, name: str):
    try:
        import wandb
    except ImportError:
        raise ValueError("log.wandb=true needs the wandb package: pip install wandb") from None
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else (cfg or {})
    return wandb.init(project=log.wandb_project, name=name, dir=str(out), config=config, reinit=True)
