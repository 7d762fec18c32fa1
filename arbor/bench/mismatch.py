"""Train/inference mismatch: GRPO without correction vs TIS vs IcePop (``arbor bench mismatch``).

The engine samples in bfloat16 with Gaussian noise of std ``noise`` added to its logits, the
trainer computes in float32, so ``logp_infer`` ≠ ``logp_old`` as between real engines and
trainers. Same tiny model, seeds and sample budget for the three objectives. A run counts as
stable when its gradient norm never exceeds 10× its first-steps median and its final reward
is no lower than its starting reward.
"""

from __future__ import annotations

import asyncio

from arbor.bench.common import median, print_table, write_result
from arbor.bench.rl_setup import make_trainer, tiny_model
from arbor.rollout.collector import RolloutConfig
from arbor.train.losses import LossConfig
from arbor.train.optim import OptimConfig
from arbor.train.rl import C3POConfig, RLConfig


def run(out_dir="bench_results", steps=20, noise=1.0, device="cpu", seed=0, lr=2e-3):
    model, tok = tiny_model(seed=seed, device=device)
    result = {"config": {"steps": steps, "engine": "bfloat16 + logit noise", "noise_std": noise, "lr": lr},
              "systems": {}}
    rows = []
    for corr in ("none", "tis", "icepop"):
        cfg = RLConfig(task="longtail", seed=seed, device=device, steps=steps, groups_per_step=8, checkpoint_every=0,
                       engine_dtype="bfloat16", engine_logit_noise=noise, loss=LossConfig(correction=corr),
                       rollout=RolloutConfig(max_turn_tokens=32, max_context=200, temperature=1.0, branch=[4]),
                       optim=OptimConfig(lr=lr, warmup_steps=0, min_lr_ratio=1.0, grad_clip=1e9),
                       c3po=C3POConfig(enabled=False))
        trainer = make_trainer(cfg, model, tok)
        hist = [asyncio.run(trainer.train_step()) for _ in range(steps)]
        g = [r["grad_norm"] for r in hist]
        rew = [r["reward"] for r in hist]
        start = median(rew[:3])
        stable = max(g) <= 10 * median(g[:5]) and median(rew[-3:]) >= start
        result["systems"][corr] = {"history": hist, "stable": stable}
        rows.append([corr, start, median(rew[-3:]), max(g), median([r["masked_frac"] for r in hist]),
                     median([r["mismatch_abs"] for r in hist]), "yes" if stable else "no"])
    print_table(f"engine bf16+noise({noise}) vs trainer fp32, {steps} steps, longtail task",
                ["correction", "reward start", "reward end", "max grad norm", "masked frac", "|logp_old-logp_infer|", "stable"], rows)

    def plot(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        for corr, r in result["systems"].items():
            a.plot([x["reward"] for x in r["history"]], label=corr)
            b.plot([x["grad_norm"] for x in r["history"]], label=corr)
        a.set_xlabel("step"), a.set_ylabel("reward"), a.legend()
        b.set_xlabel("step"), b.set_ylabel("grad norm"), b.set_yscale("log"), b.legend()
        return fig

    write_result(out_dir, "mismatch", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--noise", type=float, default=1.0)


def main(args) -> None:
    run(out_dir=args.out, steps=args.steps, noise=args.noise, device=args.device)
