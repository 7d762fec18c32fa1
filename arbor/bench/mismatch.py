"""Train/inference mismatch: GRPO without correction vs TIS vs IcePop (``arbor bench mismatch``).

The engine samples in bfloat16 and, on a fraction ``noise_frac`` of the positions it samples, adds
heavy-tailed noise (``noise_dist``, scale ``noise``) to its logits; the trainer computes in float32.
So ``logp_infer`` differs from ``logp_old`` as between a real engine and trainer, with the rare
large jumps (a near-tie flipping in an MoE router, a kernel's bad rounding) that IcePop exists
for. Several PPO mini-batches per step, no gradient clipping (``grad_clip`` 1e9: a blow-up shows
instead of being hidden), same model, seeds and samples for each objective.

Per step and seed: reward, gradient norm, |logp_old − logp_infer|, masked fraction, entropy.
A run *degrades* when its reward over the last quarter of the run falls below its reward over the
first quarter, or its gradient norm is ever NaN (such optimizer steps are skipped and counted:
``optim.skip_nonfinite``) or above 10× the median of its first 5 steps.
The defaults are the regime found to break uncorrected GRPO (docs/benchmarks/mismatch.md): Cauchy noise of scale 2
on 20 % of positions, lr 2e-2, 4 epochs × 4 mini-batches per step, 40 steps.
"""

from __future__ import annotations

import asyncio

from arbor.bench.common import median, print_table, write_result
from arbor.bench.rl_setup import make_trainer, tiny_model
from arbor.rollout.collector import RolloutConfig
from arbor.train.losses import LossConfig
from arbor.train.optim import OptimConfig
from arbor.engine.config import EngineConfig
from arbor.train.config import C3POConfig, RLConfig

CURVES = ("reward", "grad_norm", "mismatch_abs", "masked_frac", "entropy", "skipped_steps")


def rl_config(correction: str, seed: int, a) -> RLConfig:
    return RLConfig(task="longtail", seed=seed, device=a.device, steps=a.steps, groups_per_step=a.groups,
                    checkpoint_every=0, replay_routing=a.replay_routing,
                    engine=EngineConfig(dtype="bfloat16", logit_noise=a.noise, logit_noise_dist=a.noise_dist,
                                        logit_noise_frac=a.noise_frac),
                    ppo_epochs=a.ppo_epochs, mini_batches=a.mini_batches, loss=LossConfig(correction=correction),
                    rollout=RolloutConfig(max_turn_tokens=a.max_tokens, max_context=a.max_tokens + 64,
                                          temperature=1.0, branch=[4]),
                    optim=OptimConfig(lr=a.lr, warmup_steps=0, min_lr_ratio=1.0, grad_clip=1e9, skip_nonfinite=True),
                    c3po=C3POConfig(enabled=False))


def degraded(hist: list[dict]) -> bool:
    q = max(1, len(hist) // 4)
    rew, g = [r["reward"] for r in hist], [r["grad_norm"] for r in hist]
    blown = any(r["skipped_steps"] for r in hist) or any(x != x for x in g) or max(g) > 10 * median(g[:5])
    return blown or median(rew[-q:]) < median(rew[:q])


def run(a) -> dict:
    result = {"config": {k: v for k, v in vars(a).items() if k not in ("func",)}, "runs": {}}
    for seed in range(a.seeds):
        model, tok = tiny_model(a.model, seed=seed, device=a.device)
        for corr in a.corrections:
            trainer = make_trainer(rl_config(corr, seed, a), model, tok)
            hist = [asyncio.run(trainer.train_step()) for _ in range(a.steps)]
            result["runs"].setdefault(corr, []).append({k: [r[k] for r in hist] for k in CURVES} |
                                                       {"degraded": degraded(hist)})
            print(f"  seed {seed} {corr:6s}: reward {hist[0]['reward']:.3f} → {hist[-1]['reward']:.3f}, "
                  f"max grad norm {max(r['grad_norm'] for r in hist if r['grad_norm'] == r['grad_norm']):.3g}, "
                  f"NaN steps skipped {sum(r['skipped_steps'] for r in hist):.0f}, degraded {degraded(hist)}", flush=True)
    rows = []
    q = max(1, a.steps // 4)
    for corr, runs in result["runs"].items():
        rows.append([corr, median([median(r["reward"][:q]) for r in runs]), median([median(r["reward"][-q:]) for r in runs]),
                     max(x for r in runs for x in r["grad_norm"] if x == x), median([median(r["masked_frac"]) for r in runs]),
                     median([median(r["mismatch_abs"]) for r in runs]), median([median(r["entropy"][-q:]) for r in runs]),
                     sum(sum(r["skipped_steps"]) for r in runs), f"{sum(r['degraded'] for r in runs)}/{len(runs)}"])
    print_table(f"engine bf16 + {a.noise_dist}({a.noise}) noise on {a.noise_frac:.0%} of positions vs trainer fp32, "
                f"{a.model}, {a.steps} steps x {a.ppo_epochs} epochs x {a.mini_batches} mini-batches, {a.seeds} seeds",
                ["correction", "reward first 1/4", "reward last 1/4", "max grad norm", "masked frac",
                 "|logp_old-logp_infer|", "entropy last 1/4", "NaN steps skipped", "degraded runs"], rows)
    runs = result["runs"]
    result["targets"] = [t for t in (
        _target("uncorrected GRPO degrades (runs)", runs.get("none"), lambda n: n >= (a.seeds + 1) // 2, True),
        _target("IcePop stays stable (runs)", runs.get("icepop"), lambda n: n == 0, False)) if t]

    def plot(plt):
        fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.4))
        colors = {"none": "tab:red", "tis": "tab:blue", "icepop": "tab:green"}
        for ax, key in zip(axes, CURVES):
            for corr, rs in runs.items():
                for i, r in enumerate(rs):
                    ax.plot(r[key], color=colors.get(corr), alpha=0.8, lw=1, label=corr if i == 0 else None)
            ax.set_title(key), ax.set_xlabel("RL step")
            if key == "grad_norm" and any(v > 0 for rs in runs.values() for r in rs for v in r[key]):
                ax.set_yscale("log")
        axes[0].legend()
        fig.tight_layout()
        return fig

    write_result(a.out, "mismatch", result, plot)
    return result


def _target(name, runs, ok, degrade: bool):
    if not runs:
        return None
    n = sum(r["degraded"] for r in runs)
    want = f">= {(len(runs) + 1) // 2} of {len(runs)}" if degrade else f"0 of {len(runs)}"
    return {"name": name, "value": n, "target": want, "met": bool(ok(n))}


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-moe", help="preset: tiny, tiny-moe, tiny-hybrid")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--groups", type=int, default=8, help="groups of 4 samples per step")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--noise", type=float, default=2.0, help="scale of the engine's logit noise")
    p.add_argument("--noise-dist", default="cauchy", choices=["normal", "cauchy"])
    p.add_argument("--noise-frac", type=float, default=0.2, help="fraction of sampled positions with noise")
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--replay-routing", type=lambda s: s.lower() in ("1", "true", "yes"), default=False)
    p.add_argument("--corrections", nargs="+", default=["none", "tis", "icepop"], choices=["none", "tis", "icepop"])


def main(args) -> None:
    run(args)
