"""``make demo`` / ``arbor demo``: the main job end to end on the built-in calculator task.

1. build the built-in tokenizer and a tiny random model; SFT it on demonstrations from a solver
   that answers most short problems in its head (``mental_rate``) and works long ones with the
   calculator. The student imitates both habits but cannot do the mental arithmetic, so its
   accuracy plateaus clearly above 0 and far below 100 %. SFT stops once greedy accuracy on
   training-split problems reaches ``sft_target`` (checked every ``sft_check_every`` steps), so
   the start of RL does not hang on the machine's float rounding or the seed;
2. RL with tree rollouts (branching at the first two turns), IcePop and C3PO++: the sampled
   tool-using turns earn the reward, and the policy learns to call the calculator;
3. print held-out accuracy before and after RL, and write the reward/accuracy plot.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from arbor.rollout.collector import RolloutConfig
from arbor.train.optim import OptimConfig
from arbor.train.config import C3POConfig, RLConfig, engine_config
from arbor.train.run_log import LogConfig
from arbor.train.sft import SFTConfig, SFTRunConfig


@dataclass
class DemoConfig:
    out: str = "runs/demo"
    seed: int = 0
    eval_problems: int = 200
    sft_target: float = 0.15       # SFT stops once greedy accuracy on training-split problems reaches this
    sft_check_every: int = 100     # … checked every this many SFT steps (sft.train.steps is the most)
    sft_check_problems: int = 100
    sft: SFTRunConfig = field(default_factory=lambda: SFTRunConfig(   # the demo prints its own progress lines
        model="tiny", demos=4000, demo_options={"mental_rate": 0.7}, log=LogConfig(progress=False),
        train=SFTConfig(steps=1500, batch_tokens=4096, log_every=50,
                        optim=OptimConfig(lr=3e-3, warmup_steps=20, min_lr_ratio=1.0))))
    rl: RLConfig = field(default_factory=lambda: RLConfig(
        steps=30, eval_every=10, checkpoint_every=10, log=LogConfig(progress=False),
        rollout=RolloutConfig(max_turn_tokens=64, max_context=640, temperature=0.7, branch=[4, 2]),
        optim=OptimConfig(lr=1e-4, warmup_steps=5, betas=(0.9, 0.999), min_lr_ratio=1.0),
        c3po=C3POConfig(enabled=True, token_budget=3000, capacity=24, max_age=2)))


def demo(cfg: DemoConfig) -> dict:
    from arbor.train.rl import RLTrainer
    from arbor.train.run import make_engine, plot_history, rl_task
    from arbor.train.sft import run_sft

    out = Path(cfg.out)
    t0 = time.time()
    cfg.sft.out, cfg.sft.train.seed = str(out / "sft"), cfg.seed
    cfg.rl.out, cfg.rl.seed, cfg.rl.model = str(out / "rl"), cfg.seed, cfg.sft.out
    cfg.rl.eval_problems = cfg.eval_problems
    for stage in ("sft", "rl"):      # the demo always starts from scratch: no checkpoint of an earlier run
        if (out / stage).exists():
            shutil.rmtree(out / stage)
    built = {}

    def trainer_for(model, tok) -> RLTrainer:
        """One engine (sharing the model's tensors) and trainer, for the SFT checks and for RL."""
        if "trainer" not in built:
            engine, sampling = make_engine(model, tok, engine_config(cfg.rl))
            built["trainer"] = RLTrainer(cfg.rl, model, tok, engine, sampling, rl_task(cfg.rl, tok))
        return built["trainer"]

    def until(model, tok, step) -> bool:
        if (step + 1) % cfg.sft_check_every:
            return False
        trainer = trainer_for(model, tok)
        trainer.engine.update_weights(model.state_dict())     # drops KV cached under older weights
        acc = asyncio.run(trainer.evaluate(cfg.sft_check_problems, split="train"))
        print(f"  sft step {step + 1:4d}  greedy accuracy on {cfg.sft_check_problems} training problems {acc:.1%}"
              f"{'  (target reached)' if acc >= cfg.sft_target else ''}", flush=True)
        return acc >= cfg.sft_target

    print(f"[1/3] SFT: tiny model, up to {cfg.sft.train.steps} steps on {cfg.sft.demos} calculator demonstrations "
          f"({cfg.sft.demo_options or 'ideal solver'}) until training accuracy ≥ {cfg.sft_target:.0%}")
    model, tok, _ = run_sft(cfg.sft, until=until,
                            on_log=lambda r: print(f"  sft step {r['step']:4d}  loss {r['loss']:.3f}", flush=True))
    trainer = trainer_for(model, tok)
    trainer.engine.update_weights(model.state_dict())
    before = asyncio.run(trainer.evaluate())
    print(f"[2/3] held-out accuracy after SFT: {before:.1%}  ({time.time() - t0:.0f}s)")
    print(f"[3/3] RL: {cfg.rl.steps} steps, tree rollouts branch={cfg.rl.rollout.branch}, "
          f"loss={cfg.rl.loss.correction}, C3PO++ budget={cfg.rl.c3po.token_budget}")

    def on_row(r):
        acc = f"  held-out {r['test_accuracy']:.1%}" if "test_accuracy" in r else ""
        print(f"  rl step {r['step']:3d}  reward {r.get('reward', 0):.2f}  samples {r.get('samples', 0):3d}  "
              f"masked {r.get('masked_frac', 0):.4f}  sync {r.get('sync_s', 0) * 1e3:.1f}ms{acc}", flush=True)

    history = asyncio.run(trainer.run(on_row))
    after = asyncio.run(trainer.evaluate())
    history.insert(0, {"step": -1, "test_accuracy": before})
    plot_history(history, out / "demo.png", f"calculator task, seed {cfg.seed}: {before:.0%} → {after:.0%}")
    result = {"seed": cfg.seed, "accuracy_before": before, "accuracy_after": after,
              "gain_points": 100 * (after - before), "seconds": time.time() - t0}
    (out / "demo.json").write_text(json.dumps(result, indent=2))
    print(f"held-out accuracy: {before:.1%} after SFT → {after:.1%} after RL "
          f"({result['gain_points']:+.1f} points) in {result['seconds'] / 60:.1f} min; plot: {out / 'demo.png'}")
    return result
