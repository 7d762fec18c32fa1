"""Train/inference mismatch: GRPO without correction vs TIS vs IcePop (``arbor bench mismatch``).

The engine samples in bfloat16 and, on a fraction ``noise_frac`` of the positions it samples, adds
heavy-tailed noise (``noise_dist``, scale ``noise``) to its logits; the trainer computes in float32.
So ``logp_infer`` differs from ``logp_old`` as between a real engine and trainer, with the rare
large jumps (a near-tie flipping in an MoE router, a kernel's bad rounding) that IcePop exists
for. Several PPO mini-batches per step, no gradient clipping (``grad_clip`` 1e9: a blow-up shows
instead of being hidden), same model, seeds and samples for each objective.

Degradation is judged on the policy, not on the training log:

- held-out reward: every ``eval_every`` steps (and at steps 0 and ``steps``) the trainer's weights
  decode the first ``eval_prompts`` rows of the task's test split greedily, without logit noise, in
  two numerics: ``heldout_reward`` through a float32 engine serving the trainer's own tensors (the
  policy itself), ``heldout_reward_engine`` through an engine in the rollout engine's dtype holding a
  synced copy (the policy as served). A curve's *drop* = peak − final (final: its last evaluation);
  the run **falls** (``falls``, ``falls_engine``) when drop ≥ ``drop_tol``.
- entropy collapse: median per-token entropy of the last quarter of steps ÷ the entropy at step 0
  (collapsed below 0.05);
- mismatch growth: median |logp_old − logp_infer| of the last quarter ÷ that of the first quarter,
  over the steps where it is finite (``mismatch_nan_steps`` counts the others: NaN engine log-probs).

Steps whose gradient norm is not finite are skipped by ``optim.skip_nonfinite`` and only counted
(``skipped_steps``): they leave the weights unchanged, so they are no degradation by themselves.

Targets (from the run): uncorrected GRPO's held-out reward falls on ≥ half the seeds; IcePop's holds on
every seed (each in both numerics); IcePop's final held-out reward exceeds GRPO's (median over seeds); GRPO's mismatch grows
more than IcePop's. A target the run misses stays "not met", with the measured values beside it. Defaults: Cauchy
noise of scale 2 on 20 % of positions, lr 2e-2, 4 epochs × 4 mini-batches per step, 120 steps,
``tiny-moe`` with routing replay off, 3 seeds.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math

from arbor.bench.common import median, print_table, write_result
from arbor.bench.rl_setup import make_trainer, tiny_model
from arbor.engine.config import EngineConfig
from arbor.rollout.collector import RolloutConfig
from arbor.train.config import C3POConfig, RLConfig, engine_config
from arbor.train.lora import sync_tensors
from arbor.train.losses import LossConfig
from arbor.train.optim import OptimConfig
from arbor.train.rl_eval import evaluate_rows
from arbor.train.run import make_engine

CURVES = ("reward", "grad_norm", "mismatch_abs", "masked_frac", "entropy")
ENTROPY_COLLAPSE = 0.05      # last-quarter entropy below this fraction of step 0's


def rl_config(correction: str, seed: int, a) -> RLConfig:
    return RLConfig(task="longtail", seed=seed, device=a.device, steps=a.steps, groups_per_step=a.groups,
                    checkpoint_every=0, replay_routing=a.replay_routing, eval_problems=a.eval_prompts,
                    engine=EngineConfig(dtype="bfloat16", logit_noise=a.noise, logit_noise_dist=a.noise_dist,
                                        logit_noise_frac=a.noise_frac),
                    ppo_epochs=a.ppo_epochs, mini_batches=a.mini_batches, loss=LossConfig(correction=correction),
                    rollout=RolloutConfig(max_turn_tokens=a.max_tokens, max_context=a.max_tokens + 64,
                                          temperature=1.0, branch=[4]),
                    optim=OptimConfig(lr=a.lr, warmup_steps=0, min_lr_ratio=1.0, grad_clip=1e9, skip_nonfinite=True),
                    c3po=C3POConfig(enabled=False))


def heldout_evaluator(trainer, dtype: str = "float32"):
    """→ a function giving the greedy held-out reward of ``trainer``'s current weights, decoded without
    logit noise by an engine in ``dtype``: float32 serves the trainer's own tensors (always current);
    another dtype holds a copy, synced before each evaluation."""
    cfg = dataclasses.replace(engine_config(trainer.cfg), dtype=dtype, logit_noise=0.0, share_weights=True)
    judge = copy.copy(trainer)
    judge.engine, _ = make_engine(trainer.model, trainer.tok, cfg)
    rows = trainer.task.eval[:trainer.cfg.eval_problems]

    def heldout() -> float:
        was = trainer.model.training
        trainer.model.eval()
        if dtype != "float32":
            judge.engine.update_weights(sync_tensors(trainer.model))
        metrics, _ = asyncio.run(evaluate_rows(judge, rows, samples=1))
        trainer.model.train(was)
        return metrics["eval_reward"]
    return heldout


def finite_median(xs) -> float:
    """Median of the finite values of xs (NaN when there are none)."""
    xs = [x for x in xs if math.isfinite(x)]
    return median(xs) if xs else math.nan


def verdict(run: dict, drop_tol: float) -> dict:
    """The policy's figures of one run (module docstring)."""
    q = max(1, len(run["reward"]) // 4)
    h, he, ent, mis = run["heldout_reward"], run["heldout_reward_engine"], run["entropy"], run["mismatch_abs"]
    return {"heldout_peak": max(h), "heldout_final": h[-1], "heldout_drop": max(h) - h[-1],
            "falls": max(h) - h[-1] >= drop_tol, "heldout_engine_final": he[-1],
            "heldout_engine_drop": max(he) - he[-1], "falls_engine": max(he) - he[-1] >= drop_tol,
            "entropy_ratio": median(ent[-q:]) / max(ent[0], 1e-12),
            "entropy_collapsed": median(ent[-q:]) < ENTROPY_COLLAPSE * ent[0],
            "mismatch_growth": finite_median(mis[-q:]) / max(finite_median(mis[:q]), 1e-12),
            "mismatch_nan_steps": sum(not math.isfinite(x) for x in mis)}


def run(a) -> dict:
    result = {"config": {k: v for k, v in vars(a).items() if k not in ("func",)}, "runs": {}}
    for seed in range(a.seeds):
        model, tok = tiny_model(a.model, seed=seed, device=a.device)
        for corr in a.corrections:
            trainer = make_trainer(rl_config(corr, seed, a), model, tok)
            judges = (heldout_evaluator(trainer), heldout_evaluator(trainer, trainer.cfg.engine.dtype))
            hist, evals = [], [(0, *(j() for j in judges))]
            for step in range(1, a.steps + 1):
                hist.append(asyncio.run(trainer.train_step()))
                if step % a.eval_every == 0 or step == a.steps:
                    evals.append((step, *(j() for j in judges)))
            r = {k: [row[k] for row in hist] for k in CURVES}
            r.update(heldout_steps=[e[0] for e in evals], heldout_reward=[e[1] for e in evals],
                     heldout_reward_engine=[e[2] for e in evals], skipped_steps=[row["skipped_steps"] for row in hist])
            r.update(verdict(r, a.drop_tol))
            result["runs"].setdefault(corr, []).append(r)
            print(f"  seed {seed} {corr:6s}: held-out {r['heldout_reward'][0]:.3f} → peak {r['heldout_peak']:.3f} → "
                  f"{r['heldout_final']:.3f} (falls {r['falls']}; as served: {r['heldout_engine_final']:.3f}, "
                  f"falls {r['falls_engine']}), train reward {hist[0]['reward']:.3f} → "
                  f"{hist[-1]['reward']:.3f}, entropy ×{r['entropy_ratio']:.3f}, mismatch ×{r['mismatch_growth']:.2f}, "
                  f"NaN engine log-prob steps {r['mismatch_nan_steps']}, NaN steps skipped {sum(r['skipped_steps']):.0f}",
                  flush=True)
    runs = result["runs"]
    rows = [[corr, median([x["heldout_peak"] for x in rs]), median([x["heldout_final"] for x in rs]),
             f"{sum(x['falls'] for x in rs)}/{len(rs)}", median([x["heldout_engine_final"] for x in rs]),
             f"{sum(x['falls_engine'] for x in rs)}/{len(rs)}", median([x["entropy_ratio"] for x in rs]),
             finite_median([x["mismatch_growth"] for x in rs]), median([median(x["masked_frac"]) for x in rs]),
             sum(x["mismatch_nan_steps"] for x in rs), sum(sum(x["skipped_steps"]) for x in rs)] for corr, rs in runs.items()]
    print_table(f"engine bf16 + {a.noise_dist}({a.noise}) noise on {a.noise_frac:.0%} of positions vs trainer fp32, "
                f"{a.model}, {a.steps} steps x {a.ppo_epochs} epochs x {a.mini_batches} mini-batches, lr {a.lr}, "
                f"{a.seeds} seeds; held-out: greedy, {a.eval_prompts} test prompts",
                ["correction", "held-out peak", "held-out final", f"falls >= {a.drop_tol}", "as served: final", "falls",
                 "entropy last/first", "mismatch growth", "masked frac", "NaN log-prob steps", "NaN steps skipped"], rows)
    result["targets"] = targets(runs, a.drop_tol)

    def plot(plt):
        keys = ("reward", "heldout_reward", "heldout_reward_engine", "entropy", "mismatch_abs", "grad_norm")
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4))
        colors = {"none": "tab:red", "tis": "tab:blue", "icepop": "tab:green"}
        for ax, key in zip(axes, keys):
            for corr, rs in runs.items():
                for i, r in enumerate(rs):
                    x = r["heldout_steps"] if key.startswith("heldout") else range(1, len(r[key]) + 1)
                    ax.plot(list(x), r[key], color=colors.get(corr), alpha=0.8, lw=1, label=corr if i == 0 else None)
            ax.set_title({"heldout_reward": "held-out reward (greedy, fp32)",
                          "heldout_reward_engine": "held-out reward (greedy, as served)"}.get(key, key))
            ax.set_xlabel("RL step")
            if key == "grad_norm" and any(v > 0 for rs in runs.values() for r in rs for v in r[key]):
                ax.set_yscale("log")
        axes[0].legend()
        fig.tight_layout()
        return fig

    write_result(a.out, "mismatch", result, plot)
    return result


def targets(runs: dict, drop_tol: float) -> list[dict]:
    """The bench's target entries from its runs (module docstring); a comparison whose runs are missing
    is left out."""
    out = []
    none, icepop = runs.get("none"), runs.get("icepop")
    for key, where in (("falls", ""), ("falls_engine", " as served")):
        if none:
            n, want = sum(r[key] for r in none), (len(none) + 1) // 2
            out.append({"name": f"uncorrected GRPO: held-out reward{where} falls >= {drop_tol} from its peak (runs)",
                        "value": n, "target": f">= {want}", "met": n >= want})
        if icepop:
            n = sum(r[key] for r in icepop)
            out.append({"name": f"IcePop: held-out reward{where} falls >= {drop_tol} from its peak (runs)",
                        "value": n, "target": "== 0", "met": n == 0})
    if none and icepop:
        gap = median([r["heldout_final"] for r in icepop]) - median([r["heldout_final"] for r in none])
        out.append({"name": "final held-out reward, IcePop - GRPO (median over seeds)",
                    "value": gap, "target": "> 0", "met": gap > 0})
        ratio = (finite_median([r["mismatch_growth"] for r in none])
                 / max(finite_median([r["mismatch_growth"] for r in icepop]), 1e-12))
        out.append({"name": "|logp_old - logp_infer| growth, GRPO / IcePop (median over seeds with a finite one)",
                    "value": ratio, "target": "> 1", "met": ratio > 1})
    return out


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-moe", help="preset: tiny, tiny-moe, tiny-hybrid")
    p.add_argument("--steps", type=int, default=120)
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
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out (test split) prompts, decoded greedily")
    p.add_argument("--drop-tol", type=float, default=0.1, help="a held-out drop from the peak this large is a fall")
    p.add_argument("--corrections", nargs="+", default=["none", "tis", "icepop"], choices=["none", "tis", "icepop"])


def main(args) -> None:
    run(args)
