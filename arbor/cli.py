"""The ``arbor`` command. Each subcommand is registered by one small ``add_*`` function listed in
``SUBCOMMANDS``; handlers call library code and hold no logic a library user would need.

Benchmarks: ``arbor bench NAME`` — every module ``arbor.bench.NAME`` (``-`` read as ``_``) listed in ``BENCHMARKS``
defines ``add_arguments(parser)`` and ``main(args)``; add a name there to register one. A bench
module is imported only when that bench runs (or shows its ``--help``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

BENCHMARKS = ["model", "rl", "c3po", "mismatch", "dllm", "dllm-rl", "tree", "engine", "engine-profile", "ep", "routepack",
              "cluster", "makespan", "ttft"]


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


class ArborParser(argparse.ArgumentParser):
    """A subcommand parser; a job's (``config="module:Class"``) --help lists its config's keys, built
    only when asked so that ``arbor`` starts without importing the trainers."""

    def __init__(self, *args, config: str | None = None, **kw):
        super().__init__(*args, **kw)
        self.config = config

    def format_help(self) -> str:
        if self.config and self.epilog is None:
            from arbor import configs
            module, name = self.config.split(":")
            self.epilog = configs.help_text(getattr(importlib.import_module(module), name))
        return super().format_help()


def _job_parser(sub, name: str, help: str, config: str):
    """A job subcommand: ``arbor NAME [cfg.toml] [key=value …]``; its --help lists every key."""
    p = sub.add_parser(name, help=help, description=help, config=config,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=50 loss.correction=tis")
    return p


def _split_config(args):
    """argparse puts a leading key=value into ``config``; move it to the overrides."""
    if args.config and "=" in args.config and not args.config.endswith(".toml"):
        return None, [args.config, *args.overrides]
    return args.config, args.overrides


def add_sft(sub) -> None:
    p = _job_parser(sub, "sft", "warm-start a model on a task's demonstrations (next-token SFT)",
                    "arbor.train.sft:SFTRunConfig")

    def run(a):
        from arbor import configs
        from arbor.train.sft import SFTRunConfig, run_sft
        path, over = _split_config(a)
        cfg = configs.load(SFTRunConfig, path, over)
        run_sft(cfg)
        print(f"saved {cfg.out}")

    p.set_defaults(func=run)


def add_train(sub) -> None:
    p = _job_parser(sub, "train", "RL on a task: rollout trees, GRPO/PPO with IcePop or TIS, C3PO++; "
                    "cluster=ray runs it on Ray (engine replicas and trainer ranks as actors)",
                    "arbor.cluster.config:ClusterRLConfig")

    def run(a):
        from arbor.cluster.config import load_train_config, plain_rl_config
        path, over = _split_config(a)
        cfg = load_train_config(path, over)
        if cfg.cluster.backend == "ray":
            from arbor.cluster.run import train as train_on_ray
            train_on_ray(cfg)
            return
        from arbor.train.run import train
        train(plain_rl_config(cfg))

    p.set_defaults(func=run)


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="held-out accuracy of a model folder on a task (greedy rollouts)")
    p.add_argument("model")
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--device", default="cpu")

    def run(a):
        from arbor.train.run import evaluate_folder
        acc = evaluate_folder(a.model, a.task, a.n, a.device)
        print(f"{a.task}: held-out accuracy {acc:.1%} on {a.n} problems")

    p.set_defaults(func=run)


def add_demo(sub) -> None:
    p = _job_parser(sub, "demo", "the main job on the built-in task: SFT a tiny model, then RL",
                    "arbor.train.demo:DemoConfig")

    def run(a):
        from arbor import configs
        from arbor.train.demo import DemoConfig, demo
        path, over = _split_config(a)
        demo(configs.load(DemoConfig, path, over))

    p.set_defaults(func=run)


def add_dllm_train(sub) -> None:
    p = _job_parser(sub, "dllm-train", "masked-diffusion SFT of a tiny block-diffusion model on built-in tasks",
                    "arbor.dllm.sft:DiffusionTrainConfig")

    def run(a):
        from arbor import configs
        from arbor.dllm.sft import DiffusionTrainConfig, train_from_config
        path, over = _split_config(a)
        cfg = configs.load(DiffusionTrainConfig, path, over)
        train_from_config(cfg)
        print(f"saved {cfg.out}")

    p.set_defaults(func=run)


def add_dllm_distill(sub) -> None:
    p = _job_parser(sub, "dllm-distill", "TAD trajectory self-distillation → Quality and Speed students",
                    "arbor.dllm.tad:DistillRunConfig")

    def run(a):
        from arbor import configs
        from arbor.dllm.tad import DistillRunConfig, distill_folder
        path, over = _split_config(a)
        for mode, folder in distill_folder(configs.load(DistillRunConfig, path, over)).items():
            print(f"{mode}: saved {folder}")

    p.set_defaults(func=run)


_UNSET = object()


def _threshold_or_none(text: str):
    return None if text.lower() == "none" else float(text)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate completions of prompts from a checkpoint")
    p.add_argument("model", help="HF-layout checkpoint folder")
    p.add_argument("prompts", nargs="*")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; same as positional)")
    p.add_argument("--device", default="cpu")
    a = p.add_argument_group("autoregressive (arbor.engine.LLMEngine)")
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--seed", type=int)
    a.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    d = p.add_argument_group("block diffusion (the default for block-diffusion checkpoints)")
    d.add_argument("--diffusion", action="store_true", help="decode with arbor.dllm.decoding")
    d.add_argument("--mode", choices=["quality", "speed", "threshold"], default="quality",
                   help="LLaDA2.1 preset, or Fast-dLLM threshold decoding")
    d.add_argument("--method", choices=["editing", "threshold", "low_confidence"])
    d.add_argument("--threshold", type=float)
    d.add_argument("--editing-threshold", type=_threshold_or_none, default=_UNSET, help="a float, or 'none' (off)")
    d.add_argument("--max-post-steps", type=int)
    d.add_argument("--block-size", type=int, help="default: the model's block_size")
    d.add_argument("--steps-per-block", type=int)
    d.add_argument("--gen-length", type=int, default=32)
    d.add_argument("--no-cache", action="store_true", help="re-forward all blocks every step (reference path)")
    d.add_argument("--show-steps", action="store_true",
                   help="print the response after every forward (_ = mask, · = stop) with its unmasks and edits")
    p.set_defaults(func=_run_generate)


def _run_generate(a) -> None:
    from arbor.models import ModelConfig
    a.prompts = a.prompts + a.prompt
    if not a.prompts:
        raise ValueError("give at least one prompt (positional or --prompt)")
    if a.diffusion or ModelConfig.from_file(a.model).is_block_diffusion:
        return _run_diffusion_generate(a)
    return _run_engine_generate(a)


def _run_engine_generate(a) -> None:
    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(a.model, EngineConfig(dtype=a.dtype, device=a.device))
    if engine.tokenizer is None:
        raise ValueError(f"{a.model} has no tokenizer.json; text prompts need one")
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               if a.chat else p for p in a.prompts]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    for prompt, c in zip(a.prompts, engine.generate(prompts, params)):
        print(f"{prompt}{c.text}\t[{len(c.token_ids)} tokens, {c.finish_reason}, {c.latency:.2f} s]")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("model", help="HF-layout checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--policy", default="mixed",
                   choices=["mixed", "prefill-first", "pd-multiplex", "pd-global-enqueue", "layerkv"],
                   help="scheduling policy (arbor.engine.scheduler); pd-*: prefill/decode multiplexing; "
                        "layerkv: mixed + SLO-aware admission (needs --layer-kv)")
    p.add_argument("--pd-segment-layers", type=int, default=1,
                   help="pd-multiplex: layers per prefill segment (a decode step may run at each boundary)")
    p.add_argument("--layer-kv", action="store_true", help="layer-wise KV over a device and a host tier (LayerKV)")
    p.add_argument("--device-kv-blocks", type=int, help="--layer-kv: device-tier size in layer-blocks")
    p.add_argument("--host-kv-blocks", type=int, help="--layer-kv: host-tier size in blocks")
    p.add_argument("--tpot-slo", type=float, help="layerkv policy: time-per-output-token SLO, seconds")
    p.add_argument("--ttft-slo", type=float, help="layerkv policy: time-to-first-token SLO, seconds")
    p.add_argument("--served-model-name", help="default: the folder name")
    p.add_argument("--ranks", type=int, default=1,
                   help="serve from N local ranks (data-parallel attention; experts split when MoE)")
    p.add_argument("--api-key", default=os.environ.get("ARBOR_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route (default: $ARBOR_API_KEY; none: open)")
    p.add_argument("--enable-weight-updates", action="store_true", help="allow POST /update_weights")
    p.add_argument("--weight-updates-root",
                   help="/update_weights reads only inside this folder (default: the model folder's parent)")
    p.add_argument("--max-n", type=int, default=16, help="most samples per prompt (n)")
    p.add_argument("--max-prompts", type=int, default=64, help="most prompts in one completions request")
    p.add_argument("--max-request-tokens", type=int, default=65536,
                   help="most tokens one request may generate: prompts × n × max_tokens")
    p.add_argument("--max-body-mb", type=float, default=32, help="largest request body in MiB")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds requests may run on after SIGTERM/SIGINT before they are aborted")
    p.add_argument("--mode", default="quality", choices=["quality", "speed", "threshold"],
                   help="block-diffusion models: the decoding mode of requests that name none")

    def server_config(a):
        from arbor.serve.config import ServerConfig
        root = a.weight_updates_root or (str(Path(a.model).resolve().parent) if a.enable_weight_updates else None)
        return ServerConfig(max_n=a.max_n, max_prompts=a.max_prompts, max_request_tokens=a.max_request_tokens,
                            max_body_bytes=int(a.max_body_mb * (1 << 20)), api_key=a.api_key or None,
                            enable_weight_updates=a.enable_weight_updates, weight_updates_root=root,
                            shutdown_grace_s=a.shutdown_grace, diffusion_mode=a.mode)

    def run(a):
        from arbor.engine import EngineConfig
        from arbor.serve.server import serve
        if a.ranks < 1:
            raise ValueError(f"--ranks must be >= 1, got {a.ranks}")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if a.ranks > 1 and "WORLD_SIZE" not in os.environ:       # start the ranks, each re-running this command
            from arbor.distributed.launch import launch
            argv = ["serve", a.model]
            for act in p._actions:
                value = getattr(a, act.dest, None)
                if not act.option_strings or act.dest in ("help", "api_key") or value is None or value is False:
                    continue
                argv += [act.option_strings[-1]] + ([] if value is True else [str(value)])
            if a.api_key:           # to the ranks through the environment, not their command lines
                os.environ["ARBOR_API_KEY"] = a.api_key
            return launch([sys.executable, "-m", "arbor.cli", *argv], a.ranks).returncode
        if a.ranks > 1 and world != a.ranks:
            raise ValueError(f"--ranks {a.ranks} but this process is one of WORLD_SIZE={world} ranks")
        cfg = EngineConfig(dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
                           max_num_seqs=a.max_num_seqs, policy=a.policy, pd_segment_layers=a.pd_segment_layers,
                           layer_kv=a.layer_kv, device_kv_blocks=a.device_kv_blocks, host_kv_blocks=a.host_kv_blocks,
                           tpot_slo=a.tpot_slo, ttft_slo=a.ttft_slo)
        if world > 1:                                              # a rank (arbor launch, torchrun, --ranks)
            from arbor.engine.rank_front import serve_ranks
            return serve_ranks(a.model, a.host, a.port, cfg, a.served_model_name, server_config(a))
        serve(a.model, a.host, a.port, cfg, a.served_model_name, server_config(a))

    p.set_defaults(func=run)


def _run_diffusion_generate(a) -> None:
    from arbor.dllm.decoding import generate_text, mode_config
    from arbor.models import load_model
    from arbor.models.tokenizer import Tokenizer
    knobs = {k: getattr(a, k) for k in ("method", "threshold", "max_post_steps", "block_size", "steps_per_block")
             if getattr(a, k) is not None}
    if a.editing_threshold is not _UNSET:
        knobs["editing_threshold"] = a.editing_threshold
    cfg = mode_config(a.mode, gen_length=a.gen_length, use_cache=not a.no_cache, **knobs)
    cfg.record = a.show_steps
    model, tok = load_model(a.model, device=a.device).eval(), Tokenizer.load(a.model)
    for prompt, (text, r) in zip(a.prompts, generate_text(model, tok, a.prompts, cfg)):
        print(f"{prompt}{text}\t[{r.num_tokens} tokens, {r.forwards} forwards, TPF {r.tpf:.2f}, {r.edits} edits]")
        if a.show_steps:
            _print_steps(r.trajectory, model.config.mask_token_id, tok)


def _print_steps(trajectory, mask_id: int, tok) -> None:
    """One line per forward: the response state, and how many masks it filled and tokens it edited."""
    shown = lambda t: "_" if t == mask_id else "·" if t == tok.eos_token_id else tok.decode([t])
    before = trajectory[0].clone().fill_(mask_id) if trajectory else None      # the response starts all masked
    for i, state in enumerate(trajectory, 1):
        was_masked = before == mask_id
        filled, edited = int((was_masked & (state != mask_id)).sum()), int((~was_masked & (state != before)).sum())
        print(f"  step {i:3d}  {''.join(shown(t) for t in state.tolist())}  +{filled} unmasked, {edited} edited")
        before = state


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
    p = sub.add_parser("plan", help="RoutePack planner tools (arbor.plan)")
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
        from arbor.train.plan_calibrate import calibrate, calibrate_ep, calibrate_migration, with_ep_fit, with_migration
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
            from arbor.bench.ep import model_shape
            from arbor.bench.ep_worker import build_model
            from arbor.distributed import DistContext
            shape = model_shape(a.hidden, a.experts, a.top_k, a.moe_intermediate, a.layers, a.vocab)
            model = build_model(shape, DistContext.single(), torch.device("cpu"))
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


SUBCOMMANDS = [add_bench, add_sft, add_train, add_eval, add_demo, add_dllm_train, add_dllm_distill, add_generate, add_serve, add_launch, add_plan]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arbor", description=(
        "Arbor: RL post-training for agentic LLMs — rollout engine, multi-turn tree rollouts, tree training, "
        "mismatch-safe objectives, MoE and block-diffusion models. Jobs (sft, train, demo, dllm-train, "
        "dllm-distill) take [cfg.toml] key=value …; tools (generate, eval, serve, bench, launch, plan) take flags. "
        "`arbor COMMAND --help` for each."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArborParser)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "command", None) == "generate" and not any(e.startswith("-") for e in extra):
        args.prompts += extra          # prompts after options (`generate M "a" --max-tokens 5 "b"`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from arbor.distributed import CollectiveError, TagMismatchError
    from arbor.kernels.allocator import tune_allocator
    try:
        tune_allocator()
        result = args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"arbor {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (CollectiveError, TagMismatchError) as e:
        # a broken process group can block interpreter shutdown: leave at once
        print(f"arbor {args.command}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)
    if os.environ.get("WORLD_SIZE", "1") != "1" and argv is None:     # a rank of a multi-rank run
        from arbor.distributed.context import leave
        leave(int(result or 0))
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
