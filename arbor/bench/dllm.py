"""Block-diffusion decoding: accuracy vs tokens per forward, LLaDA2.1 editing and TAD (``arbor bench dllm``).

Trains (or loads from ``cache_dir``) a tiny block-diffusion model on the built-in tasks, distils
TAD-Quality and TAD-Speed students from it, then decodes each task's test problems with:
LLaDA low-confidence remasking (fixed steps per block), Fast-dLLM threshold decoding, and LLaDA2.1
joint M2T+T2T decoding in Quality and Speed modes. Reports (decoder, threshold) → accuracy, TPF;
and AUP per model from a threshold sweep (Fast-dLLM rule, τ from 1.0 down; y_max = best accuracy of
the three models on the task). Targets: TPF(Speed) ≥ 2·TPF(Quality) with accuracy within 5 points;
AUP(TAD-Speed) ≥ 1.5·AUP(base).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from arbor.bench.common import print_table, write_result
from arbor.engine.diffusion import DecodeConfig, diffusion_generate, quality, speed
from arbor.engine.diffusion_metrics import aup, tpf
from arbor.models import load_model, save_model
from arbor.models.tokenizer import Tokenizer
from arbor.train.diffusion import TASKS, DiffusionModelConfig, DiffusionTrainConfig, train_from_config
from arbor.train.optim import OptimConfig
from arbor.train.distill import QUALITY_DELTA, SPEED_DELTA, TADConfig, distill, teacher_trajectories

SWEEP = (1.0, 0.9, 0.8, 0.7, 0.5, 0.3, 0.1)
DATA_VERSION = 3          # bump when a task generator changes, so cached models are retrained


def decoders(block_size: int) -> list[tuple[str, DecodeConfig]]:
    lc = [(f"low_confidence {s} steps/block", DecodeConfig(method="low_confidence", steps_per_block=s))
          for s in (block_size, 4, 2)]
    th = [(f"threshold τ={t}", DecodeConfig(method="threshold", threshold=t, editing_threshold=None))
          for t in (0.9, 0.7, 0.5)]
    return lc + th + [("LLaDA2.1 Quality", quality(block_size=block_size)),
                      ("LLaDA2.1 Speed", speed(block_size=block_size)),
                      ("Quality, max_post_steps=0", quality(block_size=block_size, max_post_steps=0)),
                      ("Speed, max_post_steps=0", speed(block_size=block_size, max_post_steps=0))]


def evaluate(model, tok, task: str, problems, cfg: DecodeConfig) -> dict:
    """Accuracy (%, mean task score) and TPF of ``cfg`` on ``problems``."""
    mod = TASKS[task]
    cfg = replace(cfg, gen_length=mod.GEN_LENGTH)
    results = diffusion_generate(model, [tok.encode(p.prompt) for p in problems], cfg, [tok.eos_token_id])
    scores = [mod.score(p, tok.decode(r.tokens[:r.num_tokens])) for p, r in zip(problems, results)]
    return {"accuracy": 100.0 * sum(scores) / len(scores),
            "tpf": tpf([r.num_tokens for r in results], [r.forwards for r in results]),
            "edits": sum(r.edits for r in results) / len(results)}


def cached_models(cache_dir, train_steps: int, tad_steps: int, tad_per_task: int, device: str, log=print):
    """base, TAD-Quality and TAD-Speed models (trained once, then loaded from cache_dir)."""
    cache = Path(cache_dir)
    base_dir = cache / f"v{DATA_VERSION}_base_s{train_steps}"
    if not (base_dir / "config.json").exists():
        cfg = DiffusionTrainConfig(steps=train_steps, batch_size=48, device=device, log_every=250,
                                   model=DiffusionModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3))
        train_from_config(cfg, out_dir=base_dir, on_log=log)
    tok = Tokenizer.load(base_dir)
    models = {"base": load_model(base_dir, device=device).eval()}
    trajectories = None
    for name, delta in (("TAD-Quality", QUALITY_DELTA), ("TAD-Speed", SPEED_DELTA)):
        folder = cache / f"v{DATA_VERSION}_{name.lower()}_s{train_steps}_t{tad_steps}_d{delta}"
        if not (folder / "config.json").exists():
            if trajectories is None:
                trajectories = teacher_trajectories(models["base"], tok, list(TASKS), tad_per_task)
                log(f"TAD: {len(trajectories)} correct teacher trajectories")
            student = load_model(base_dir, device=device)
            tad = TADConfig(delta=delta, steps=tad_steps, optim=OptimConfig(lr=1e-3, warmup_steps=20))
            distill(student, trajectories, tad, teacher=models["base"], on_log=log)
            save_model(student, folder, tokenizer=tok)
        models[name] = load_model(folder, device=device).eval()
    return models, tok


def run(out_dir="bench_results", cache_dir="runs/dllm_cache", train_steps=2500, tad_steps=400, tad_per_task=400,
        n_eval=100, device="cpu", tasks=tuple(TASKS)) -> dict:
    t0 = time.time()
    models, tok = cached_models(cache_dir, train_steps, tad_steps, tad_per_task, device)
    B = models["base"].config.block_size
    result = {"config": {"train_steps": train_steps, "tad_steps": tad_steps, "tad_per_task": tad_per_task,
                         "n_eval": n_eval, "block_size": B, "sweep": SWEEP}, "tasks": {}}
    rows, aup_rows = [], []
    for task in tasks:
        problems = TASKS[task].generate(n_eval, seed=1234, split="test")
        table = {name: evaluate(models["base"], tok, task, problems, cfg) for name, cfg in decoders(B)}
        for name, r in table.items():
            rows.append([task, name, r["accuracy"], r["tpf"], r["edits"]])
        curves = {m: [evaluate(model, tok, task, problems, DecodeConfig(method="threshold", threshold=t))
                      for t in SWEEP] for m, model in models.items()}
        modes = {m: {mode: evaluate(model, tok, task, problems, cfg(block_size=B)) for mode, cfg in
                     (("quality", quality), ("speed", speed))} for m, model in models.items()}
        y_max = max(p["accuracy"] for c in curves.values() for p in c)
        aups = {m: aup([(p["tpf"], p["accuracy"]) for p in c], y_max) for m, c in curves.items()}
        for m in models:
            aup_rows.append([task, m, aups[m], aups[m] / max(aups["base"], 1e-9), modes[m]["quality"]["accuracy"],
                             modes[m]["quality"]["tpf"], modes[m]["speed"]["accuracy"], modes[m]["speed"]["tpf"]])
        q, s = table["LLaDA2.1 Quality"], table["LLaDA2.1 Speed"]
        result["tasks"][task] = {
            "decoders": table, "sweeps": curves, "modes": modes, "aup": aups, "y_max": y_max,
            "targets": {"speed_tpf_over_quality": s["tpf"] / max(q["tpf"], 1e-9),
                        "speed_accuracy_drop": q["accuracy"] - s["accuracy"],
                        "tad_speed_aup_over_base": aups["TAD-Speed"] / max(aups["base"], 1e-9)}}
    print_table("base model: decoder → accuracy (%), TPF", ["task", "decoder", "accuracy", "TPF", "edits/problem"], rows)
    print_table("AUP (threshold sweep) and LLaDA2.1 modes per model",
                ["task", "model", "AUP", "AUP/base", "Q acc", "Q TPF", "S acc", "S TPF"], aup_rows)
    result["seconds"] = time.time() - t0

    def plot(plt):
        fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            r = result["tasks"][task]
            for m, c in r["sweeps"].items():
                ax.plot([p["tpf"] for p in c], [p["accuracy"] for p in c], marker="o", label=f"{m} (AUP {r['aup'][m]:.0f})")
            for name, p in r["decoders"].items():
                ax.scatter(p["tpf"], p["accuracy"], marker="x")
                ax.annotate(name, (p["tpf"], p["accuracy"]), fontsize=6)
            ax.set(title=task, xlabel="tokens per forward (TPF)", ylabel="accuracy (%)")
            ax.legend(fontsize=7)
        return fig

    write_result(out_dir, "dllm", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--cache", default="runs/dllm_cache", help="folder of the trained tiny models")
    p.add_argument("--train-steps", type=int, default=2500)
    p.add_argument("--tad-steps", type=int, default=400)
    p.add_argument("--tad-per-task", type=int, default=400)
    p.add_argument("--n-eval", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def main(args) -> None:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    run(out_dir=args.out, cache_dir=args.cache, train_steps=args.train_steps, tad_steps=args.tad_steps,
        tad_per_task=args.tad_per_task, n_eval=args.n_eval, device=args.device)
