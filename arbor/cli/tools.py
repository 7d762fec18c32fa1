"""Tool subcommands: ``arbor bench NAME``, ``arbor launch``, ``arbor plan calibrate``.

Benchmarks: ``arbor bench NAME`` — every module ``arbor.bench.NAME`` (``-`` read as ``_``) listed in ``BENCHMARKS``
defines ``add_arguments(parser)`` and ``main(args)``; add a name there to register one. A bench
module is imported only when that bench runs (or shows its ``--help``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = ["model", "rl", "c3po", "mismatch", "dllm", "dllm-rl", "tree", "engine", "engine-profile", "ep", "routepack",
              "routepack-rl",
              "cluster", "makespan", "ttft", "sandbox", "train-memory", "lora", "e2e", "render"]


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark program (prints a ratio table, writes JSON + PNG)",
                       description="arbor bench NAME [--help | options]; NAME is one of: " + ", ".join(BENCHMARKS))
    p.add_argument("bench", choices=BENCHMARKS, metavar="NAME", help=" | ".join(BENCHMARKS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the bench's options (arbor bench NAME --help)")
    p.set_defaults(func=_run_bench)


def bench_parser(name: str):
    """→ (the parser of ``arbor bench NAME``, the bench module), importing the module."""
    module = importlib.import_module(f"arbor.bench.{name.replace('-', '_')}")
    b = argparse.ArgumentParser(prog=f"arbor bench {name}", description=(module.__doc__ or "").strip())
    b.add_argument("--out", default="bench_results", help="folder for NAME.json and NAME.png")
    b.add_argument("--device", default="cpu")
    module.add_arguments(b)
    return b, module


def _run_bench(a):
    parser, module = bench_parser(a.bench)
    args = parser.parse_args(a.args)
    args.bench, args.command = a.bench, "bench"
    return module.main(args)


def add_launch(sub) -> None:
    p = sub.add_parser("launch", help="run an arbor subcommand on N local ranks (torchrun's environment)")
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default: cores ÷ ranks)")
    p.add_argument("--timeout", type=float, help="seconds before every rank is killed (default: none)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the subcommand and its arguments, e.g. train k=v")

    def run(a):
        from arbor.distributed.launch import launch
        if not a.command:
            raise ValueError("give the subcommand to run, e.g. `arbor launch -n 2 sft model=tiny-moe`")
        if a.command[0] == "launch":
            raise ValueError("`arbor launch` cannot launch itself")
        return launch([sys.executable, "-m", "arbor.cli", *a.command], a.nprocs, a.threads, a.timeout).returncode

    p.set_defaults(func=run)


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="plans before running: a job's memory (memory), RoutePack's cost model (calibrate)")
    plan = p.add_subparsers(dest="plan", required=True)
    c = plan.add_parser("calibrate", help="measure this machine and fit the planner's cost model (JSON)")
    c.add_argument("--model", help="HF folder of the MoE model to measure (default: the bench ep shape)")
    for flag, default in (("--hidden", 512), ("--experts", 16), ("--top-k", 2), ("--moe-intermediate", 512),
                          ("--layers", 4), ("--vocab", 2048)):
        c.add_argument(flag, type=int, default=default, help="shape without --model (random weights)")
    c.add_argument("--threads", type=int, default=1, help="intra-op threads (one per EP rank on a 2-core CPU)")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--out", help="where to write the JSON (default: $ARBOR_CACHE or ~/.cache/arbor/plan_cost.json)")
    c.add_argument("--no-migration", action="store_true",
                   help="skip timing expert migrations on 2 EP ranks (seconds per moved expert and per changed layer)")
    c.add_argument("--ep", action="store_true",
                   help="fit the step coefficients (a, b, c0, c1, e) on 2 EP ranks' busy time per micro-batch "
                        "instead of one process's (what expert-parallel steps cost, exchanges included)")
    c.add_argument("--ep-slots", type=int, help="micro-batches timed with --ep (≥ 6; default 24)")
    c.add_argument("--ep-max-tokens", type=int, help="the most tokens of a rank's micro-batch with --ep (default 2048)")

    def run(a):
        import torch

        from arbor.plan.cost import default_cost_file
        from arbor.train.plan_calibrate import calibrate
        from arbor.train.plan_calibrate_ep import calibrate_ep, calibrate_migration, with_ep_fit, with_migration
        if a.repeats < 1 or a.threads < 1:
            raise ValueError(f"--repeats and --threads must be ≥ 1, got {a.repeats} and {a.threads}")
        if not a.ep and (a.ep_slots is not None or a.ep_max_tokens is not None):
            raise ValueError("--ep-slots and --ep-max-tokens shape the --ep measurement; add --ep or drop them")
        a.ep_slots = 24 if a.ep_slots is None else a.ep_slots
        a.ep_max_tokens = 2048 if a.ep_max_tokens is None else a.ep_max_tokens
        if a.ep_slots < 6 or a.ep_max_tokens < 16:
            raise ValueError(f"--ep-slots must be ≥ 6 and --ep-max-tokens ≥ 16, got {a.ep_slots} and {a.ep_max_tokens}")
        shape = None
        if a.model:
            from arbor.models import load_model
            model = load_model(a.model, dtype=torch.float32)
        else:
            from arbor.models.presets import moe_shape as model_shape
            from arbor.models.random_init import random_moe_model
            from arbor.distributed import DistContext
            shape = model_shape(a.hidden, a.experts, a.top_k, a.moe_intermediate, a.layers, a.vocab)
            model = random_moe_model(shape, DistContext.single(), torch.device("cpu"))
        if not model.config.moe_layers:
            raise ValueError("arbor plan calibrate needs an MoE model")
        cost = calibrate(model, repeats=a.repeats, threads=a.threads)
        print(f"a={cost.a:.4g} s/token  b={cost.b:.4g} s/token²  c1={cost.c1:.4g} s/sequence  "
              f"e={cost.e:.4g} s/routed row/layer  c0={cost.c0:.4g} s/micro-batch"
              f"  (R² experts {cost.meta['expert_fit_r2']:.3f}, steps {cost.meta['step_fit_r2']:.3f})")
        del model                          # the 2 ranks below build their own halves
        if a.ep:
            ep = calibrate_ep(shape, a.model, repeats=a.repeats, threads=a.threads, max_tokens=a.ep_max_tokens,
                              count=a.ep_slots)
            cost = with_ep_fit(cost, ep)
            print(f"2 EP ranks ({ep['slots']} micro-batches): a={cost.a:.4g}  b={cost.b:.4g}  c1={cost.c1:.4g}  "
                  f"e={cost.e:.4g}  c0={cost.c0:.4g}  (R² {ep['r2']:.3f}); these replace the one-process fit")
        if not a.no_migration:
            mig = calibrate_migration(shape, a.model, repeats=a.repeats, threads=a.threads)
            cost = with_migration(cost, mig)
            print(f"migration (2 EP ranks): move_s={cost.move_s:.4g} s per moved expert  "
                  f"move_layer_s={cost.move_layer_s:.4g} s per MoE layer changed  (+{mig['intercept_s']:.3g} s; "
                  f"R² {mig['r2']:.3f})")
        path = cost.save(a.out or default_cost_file())
        print(f"wrote {path}")

    c.set_defaults(func=run)

    m = plan.add_parser("memory", help="the memory plan of a training job, per rank, without running it")
    m.add_argument("model", help="a model folder (or LoRA adapter folder) or a preset name")
    m.add_argument("overrides", nargs="*", help="the job's key=value settings, e.g. dtype=bfloat16 lora.rank=16")
    m.add_argument("--job", choices=["train", "sft"], default="train", help="whose keys the overrides are (default train)")
    m.add_argument("--ranks", type=int, default=1, help="ranks of the job (arbor launch -n N), all on this host")

    def memory(a):
        import json

        from arbor import configs
        from arbor.train import memory_plan
        if a.ranks < 1:
            raise ValueError(f"--ranks must be ≥ 1, got {a.ranks}")
        if a.job == "sft":
            from arbor.train.sft import SFTRunConfig
            cfg = configs.load(SFTRunConfig, None, [f"model={json.dumps(a.model)}", *a.overrides])
            inp = memory_plan.from_sft(cfg, a.ranks)
        else:
            from arbor.train.config import RLConfig
            cfg = configs.load(RLConfig, None, [f"model={json.dumps(a.model)}", *a.overrides])
            inp = memory_plan.from_rl(cfg, a.ranks)
        memory_plan.check(inp, f"arbor {a.job}", enforce=False)

    m.set_defaults(func=memory, trailing_words="overrides")


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write a plain HF model folder from a model, a checkpoint or (--merge) a LoRA adapter")
    p.add_argument("src", help="a model folder, a training checkpoint (OUT/final, OUT/checkpoint) or a LoRA adapter folder")
    p.add_argument("out", help="the new HF folder (must not exist, or be empty)")
    p.add_argument("--merge", action="store_true", help="fold a LoRA adapter into its base's weights")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights (default: as saved)")

    def run(a):
        import torch

        from arbor.models.checkpoint import export_model
        print(f"wrote {export_model(a.src, a.out, a.merge, getattr(torch, a.dtype) if a.dtype else None)}")

    p.set_defaults(func=run)
