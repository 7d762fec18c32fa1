"""Block-diffusion decoding: accuracy vs tokens per forward, LLaDA2.1 editing and TAD (``arbor bench dllm``).

Trains (or loads from ``cache_dir``) a tiny block-diffusion model on the built-in tasks, distils
TAD-Quality and TAD-Speed students from it with ``distill_folder`` (``arbor dllm-distill``), then
decodes each task's test problems with: LLaDA low-confidence remasking (fixed steps per block),
Fast-dLLM threshold decoding, and LLaDA2.1 joint M2T+T2T decoding in Quality and Speed modes.
Reports (decoder, threshold) → accuracy, TPF, wall-clock speed-up over one token per step; and AUP
per model from a threshold sweep (Fast-dLLM rule, τ from 1.0 down; y_max = best accuracy of the
three models on the task). Targets: TPF(Speed) ≥
2·TPF(Quality) with accuracy within 5 points; AUP(TAD-Speed) ≥ 1.5·AUP(base). Each target is printed
beside the most any decoder or model could reach on the task (see ``evaluate`` and ``targets``),
with the forwards per problem split into M2T and edit-only steps and the share of first-step
confidences in (0.5, 0.7], the only band where the Speed and Quality thresholds differ.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from arbor.bench.common import print_table, print_targets, target, write_result
from arbor.dllm.decoding import DecodeConfig, diffusion_generate, quality, speed
from arbor.dllm.metrics import aup, tpf
from arbor.models import BlockDiffusionAttention, load_model
from arbor.models.tokenizer import Tokenizer
from arbor.dllm.sft import TASKS, DiffusionModelConfig, DiffusionTrainConfig, train_from_config
from arbor.train.optim import OptimConfig
from arbor.dllm.tad import DistillRunConfig, TADConfig, distill_folder
from arbor.train.run_log import LogConfig

SWEEP = (1.0, 0.9, 0.8, 0.7, 0.5, 0.3, 0.1)
DATA_VERSION = 4          # bump when a task generator changes, so cached models are retrained
BLOCK_SIZE = 64           # every task's response fits in one block
TRAIN_STEPS, TAD_STEPS, TAD_PER_TASK, TAD_LR = 2500, 1500, 1000, 1e-3


def decoders(block_size: int) -> list[tuple[str, DecodeConfig]]:
    lc = [(f"low_confidence {s} steps/block", DecodeConfig(method="low_confidence", steps_per_block=s))
          for s in (block_size, 4, 2)]
    th = [(f"threshold τ={t}", DecodeConfig(method="threshold", threshold=t, editing_threshold=None))
          for t in (0.9, 0.7, 0.5)]
    return lc + th + [("LLaDA2.1 Quality", quality(block_size=block_size)),
                      ("LLaDA2.1 Speed", speed(block_size=block_size)),
                      ("Quality, max_post_steps=0", quality(block_size=block_size, max_post_steps=0)),
                      ("Speed, max_post_steps=0", speed(block_size=block_size, max_post_steps=0))]


def blocks_decoded(prompt_len: int, num_tokens: int, gen_length: int, block_size: int) -> int:
    """Blocks a decoder visits: from the prompt's last block to the block of the first stop token
    (or of the last response position when there is none)."""
    last = prompt_len + min(num_tokens, gen_length - 1)
    return last // block_size - prompt_len // block_size + 1


def evaluate(model, tok, task: str, problems, cfg: DecodeConfig, repeats: int = 1) -> dict:
    """Accuracy (%, mean task score), TPF, the forward passes per problem and the wall-clock seconds of
    ``cfg`` on ``problems`` (decoded as one batch; the median of ``repeats`` identical decodes).

    Every block costs at least one forward, and with editing on at least two (the step that fills its
    last mask, then one edit-only check), so TPF ≤ ``tpf_ceiling`` = Σ tokens ÷ Σ blocks (editing off)
    and ≤ ``tpf_ceiling_editing`` = Σ tokens ÷ (2·Σ blocks) (editing on)."""
    mod = TASKS[task]
    cfg = replace(cfg, gen_length=mod.GEN_LENGTH)
    B = cfg.block_size or model.config.block_size
    prompts = [tok.encode(p.prompt) for p in problems]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = diffusion_generate(model, prompts, cfg, [tok.eos_token_id])
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    scores = [mod.score(p, tok.decode(r.tokens[:r.num_tokens])) for p, r in zip(problems, results)]
    n, tokens = len(results), sum(r.num_tokens for r in results)
    blocks = sum(blocks_decoded(len(p), r.num_tokens, mod.GEN_LENGTH, B) for p, r in zip(prompts, results))
    forwards = sum(r.forwards for r in results)
    edit_only = sum(r.edit_only_forwards for r in results)
    return {"accuracy": 100.0 * sum(scores) / n,
            "tpf": tpf([r.num_tokens for r in results], [r.forwards for r in results]),
            "edits": sum(r.edits for r in results) / n,
            "forwards": forwards / n, "m2t_forwards": (forwards - edit_only) / n, "edit_only_forwards": edit_only / n,
            "blocks": blocks / n, "tpf_ceiling": tokens / blocks, "tpf_ceiling_editing": tokens / (2 * blocks),
            "seconds": seconds}


def first_step_confidence(model, tok, task: str, problems) -> dict:
    """Shares of the first block's response positions whose confidence max softmax at the block's first
    forward (everything masked) is ≤ 0.5, in (0.5, 0.7], > 0.7: Speed (τ = 0.5) unmasks the middle band
    at once and Quality (τ = 0.7) does not, so that band is where their step counts can differ."""
    mod, B, mask = TASKS[task], model.config.block_size, model.config.mask_token_id
    seqs, spans = [], []
    for p in problems:
        ids = tok.encode(p.prompt)
        end = min((len(ids) // B + 1) * B, len(ids) + mod.GEN_LENGTH)
        seqs.append(ids + [mask] * (end - len(ids)))
        spans.append((len(ids), end))
    lengths = [len(x) for x in seqs]
    with torch.no_grad():
        hidden = model(torch.tensor([t for x in seqs for t in x], device=model.device),
                       BlockDiffusionAttention.from_lengths(lengths, B, model.device)).hidden
        logits = model.logits(hidden).float()
    logits[:, mask] = float("-inf")
    conf = logits.softmax(-1).max(-1).values
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0).tolist()
    c = torch.cat([conf[o + a:o + b] for o, (a, b) in zip(offsets, spans)])
    return {"low": float((c <= 0.5).float().mean()), "middle": float(((c > 0.5) & (c <= 0.7)).float().mean()),
            "high": float((c > 0.7).float().mean())}


def cached_models(cache_dir, train_steps: int, tad_steps: int, tad_per_task: int, device: str, block_size: int,
                  tad_lr: float = TAD_LR, tad_scope: str = "all", tasks=tuple(TASKS),
                  tad_visible_weight: float = 0.0, log=print):
    """→ ({task: {"base", "TAD-Quality", "TAD-Speed": model}}, tokenizer), trained once, then loaded from
    cache_dir. One base model for all tasks; the TAD students come from ``distill_folder`` (what
    ``arbor dllm-distill`` runs), distilled on the trajectories of every task (``tad_scope="all"``: the
    same students serve each task) or of that task alone (``"task"``)."""
    cache = Path(cache_dir)
    base_dir = cache / f"v{DATA_VERSION}_base_b{block_size}_s{train_steps}"
    if not (base_dir / "config.json").exists():
        cfg = DiffusionTrainConfig(steps=train_steps, device=device, log_every=250,
                                   model=DiffusionModelConfig(block_size=block_size))
        train_from_config(cfg, out_dir=base_dir, on_log=log)
    tok = Tokenizer.load(base_dir)
    base = load_model(base_dir, device=device).eval()
    groups = {"all": list(TASKS)} if tad_scope == "all" else {t: [t] for t in tasks}
    out = {}
    for group, group_tasks in groups.items():
        tag = ("" if group == "all" else f"_{group}") + (f"_v{tad_visible_weight:g}" if tad_visible_weight else "")
        run = DistillRunConfig(model=str(base_dir), mode="both", per_task=tad_per_task, tasks=group_tasks,
                               device=device, out=str(base_dir.with_name(
                                   f"{base_dir.name}_tad{tag}_p{tad_per_task}_t{tad_steps}_lr{tad_lr:g}")),
                               tad=TADConfig(steps=tad_steps, log_every=250, visible_weight=tad_visible_weight,
                                             optim=OptimConfig(lr=tad_lr, warmup_steps=20)),
                               log=LogConfig(tensorboard=False, progress=False))
        run.validate()
        folders = {mode: Path(run.out) / mode for mode in ("quality", "speed")}
        if not all((f / "config.json").exists() for f in folders.values()):
            folders = distill_folder(run, on_log=log)
        students = {"base": base, **{f"TAD-{mode.capitalize()}": load_model(f, device=device).eval()
                                     for mode, f in folders.items()}}
        out.update({t: students for t in group_tasks})
    return out, tok


def targets(q: dict, s: dict, aups: dict, curves: dict, y_max: float) -> dict:
    """The issue's two targets, each beside the most that any decoder / model could reach here:
    Speed's TPF is at most its editing ceiling (two forwards per block), and AUP ≤ ρ_max·y_max with
    ρ_max the sweep's largest TPF ceiling (one forward per block), since y·W(y) ≤ y_max."""
    rho_max = max(p["tpf_ceiling"] for c in curves.values() for p in c)
    return {"speed_tpf_over_quality": s["tpf"] / max(q["tpf"], 1e-9),
            "speed_ceiling_over_quality": s["tpf_ceiling_editing"] / max(q["tpf"], 1e-9),
            "speed_accuracy_drop": q["accuracy"] - s["accuracy"],
            "tad_speed_aup_over_base": aups["TAD-Speed"] / max(aups["base"], 1e-9),
            "aup_ceiling_over_base": rho_max * y_max / max(aups["base"], 1e-9)}


def target_list(task: str, t: dict) -> list[dict]:
    """``targets``' values of one task → the bench JSON's target entries (A: Speed ÷ Quality TPF ≥ 2
    within 5 points of accuracy; B: TAD-Speed AUP ≥ 1.5 × the base's)."""
    return [target(f"{task}: Speed TPF / Quality TPF, accuracy within 5 points", t["speed_tpf_over_quality"], ">= 2",
                   t["speed_tpf_over_quality"] >= 2 and t["speed_accuracy_drop"] <= 5),
            target(f"{task}: TAD-Speed AUP / base AUP", t["tad_speed_aup_over_base"], ">= 1.5",
                   t["tad_speed_aup_over_base"] >= 1.5)]


def run(out_dir="bench_results", cache_dir="runs/dllm_cache", train_steps=TRAIN_STEPS, tad_steps=TAD_STEPS,
        tad_per_task=TAD_PER_TASK, n_eval=300, device="cpu", tasks=tuple(TASKS), block_size=BLOCK_SIZE,
        tad_lr=TAD_LR, tad_scope="all", tad_visible_weight=0.0, repeats=3) -> dict:
    if tad_scope not in ("all", "task"):
        raise ValueError(f"tad_scope must be 'all' (one pair of students for every task) or 'task' (a pair per task), "
                         f"got {tad_scope!r}")
    t0 = time.time()
    per_task, tok = cached_models(cache_dir, train_steps, tad_steps, tad_per_task, device, block_size, tad_lr,
                                  tad_scope, tasks, tad_visible_weight)
    B = per_task[tasks[0]]["base"].config.block_size
    result = {"config": {"train_steps": train_steps, "tad_steps": tad_steps, "tad_per_task": tad_per_task,
                         "tad_lr": tad_lr, "tad_scope": tad_scope, "tad_visible_weight": tad_visible_weight,
                         "n_eval": n_eval, "block_size": B, "sweep": SWEEP, "repeats": repeats}, "tasks": {}}
    rows, aup_rows, target_rows = [], [], []
    for task in tasks:
        models = per_task[task]
        problems = TASKS[task].generate(n_eval, seed=1234, split="test")
        table = {name: evaluate(models["base"], tok, task, problems, cfg, repeats) for name, cfg in decoders(B)}
        one_per_step = table[f"low_confidence {B} steps/block"]["seconds"]
        for name, r in table.items():
            r["wall_speedup"] = one_per_step / r["seconds"]
            rows.append([task, name, r["accuracy"], r["tpf"], r["wall_speedup"], r["m2t_forwards"],
                         r["edit_only_forwards"], r["edits"]])
        curves = {m: [evaluate(model, tok, task, problems, DecodeConfig(method="threshold", threshold=t))
                      for t in SWEEP] for m, model in models.items()}
        modes = {m: {mode: evaluate(model, tok, task, problems, cfg(block_size=B)) for mode, cfg in
                     (("quality", quality), ("speed", speed))} for m, model in models.items()}
        y_max = max(p["accuracy"] for c in curves.values() for p in c)
        aups = {m: aup([(p["tpf"], p["accuracy"]) for p in c], y_max) for m, c in curves.items()}
        for m in models:
            aup_rows.append([task, m, round(aups[m]), aups[m] / max(aups["base"], 1e-9), modes[m]["quality"]["accuracy"],
                             modes[m]["quality"]["tpf"], modes[m]["speed"]["accuracy"], modes[m]["speed"]["tpf"]])
        band = first_step_confidence(models["base"], tok, task, problems)
        t = targets(table["LLaDA2.1 Quality"], table["LLaDA2.1 Speed"], aups, curves, y_max)
        target_rows.append([task, t["speed_tpf_over_quality"], t["speed_ceiling_over_quality"], t["speed_accuracy_drop"],
                            100 * band["middle"], t["tad_speed_aup_over_base"], t["aup_ceiling_over_base"]])
        result["tasks"][task] = {"decoders": table, "sweeps": curves, "modes": modes, "aup": aups, "y_max": y_max,
                                 "first_step_confidence": band, "targets": t}
    print_table("base model: decoder → accuracy (%), TPF, wall-clock speed-up over one token per step, forwards per problem",
                ["task", "decoder", "accuracy", "TPF", "wall ×", "M2T fwd", "edit-only fwd", "edits"], rows)
    print_table("AUP (threshold sweep) and LLaDA2.1 modes per model",
                ["task", "model", "AUP", "AUP/base", "Q acc", "Q TPF", "S acc", "S TPF"], aup_rows)
    print_table("targets (S÷Q TPF ≥ 2 within 5 points; TAD-S AUP ≥ 1.5× base) beside the most reachable",
                ["task", "S÷Q TPF", "S ceiling÷Q", "acc drop", "% conf in (.5,.7]", "TAD-S÷base AUP", "AUP ceiling÷base"],
                target_rows)
    result["seconds"] = time.time() - t0
    result["targets"] = [e for task in tasks for e in target_list(task, result["tasks"][task]["targets"])]
    print_targets(result["targets"])

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
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--train-steps", type=int, default=TRAIN_STEPS)
    p.add_argument("--tad-steps", type=int, default=TAD_STEPS)
    p.add_argument("--tad-per-task", type=int, default=TAD_PER_TASK)
    p.add_argument("--tad-lr", type=float, default=TAD_LR)
    p.add_argument("--tad-scope", choices=("all", "task"), default="all",
                   help="TAD students distilled on every task's trajectories (all) or one pair per task (task)")
    p.add_argument("--tad-visible-weight", type=float, default=0.0,
                   help="weight of TAD's optional CE on revealed tokens (0: the paper's loss)")
    p.add_argument("--n-eval", type=int, default=300, help="test problems per task")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), help="tasks to evaluate")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=3, help="timed decodes per decoder (the median is reported)")


def main(args) -> None:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    run(out_dir=args.out, cache_dir=args.cache, train_steps=args.train_steps, tad_steps=args.tad_steps,
        tad_per_task=args.tad_per_task, n_eval=args.n_eval, device=args.device, tasks=tuple(args.tasks),
        block_size=args.block_size, tad_lr=args.tad_lr, tad_scope=args.tad_scope,
        tad_visible_weight=args.tad_visible_weight, repeats=args.repeats)
