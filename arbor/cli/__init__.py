"""The ``arbor`` command. Each subcommand is registered by one small ``add_*`` function listed in
``SUBCOMMANDS`` (jobs in ``jobs``, generate/serve in ``serving``, bench/export/launch/plan in ``tools``);
handlers call library code and hold no logic a library user would need.
"""

from __future__ import annotations

import argparse
import os
import sys

from arbor.cli.common import ArborParser
from arbor.cli.jobs import add_demo, add_dllm_distill, add_dllm_train, add_eval, add_sft, add_train
from arbor.cli.serving import add_generate, add_serve
from arbor.cli.tools import BENCHMARKS, add_bench, add_export, add_launch, add_plan, bench_parser

__all__ = ["BENCHMARKS", "bench_parser", "build_parser", "main"]

SUBCOMMANDS = [add_bench, add_sft, add_train, add_eval, add_demo, add_dllm_train, add_dllm_distill, add_generate,
               add_serve, add_export, add_launch, add_plan]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arbor", description=(
        "Arbor: RL post-training for agentic LLMs — rollout engine, multi-turn tree rollouts, tree training, "
        "mismatch-safe objectives, MoE and block-diffusion models. Jobs (sft, train, demo, dllm-train, "
        "dllm-distill) take [cfg.toml] key=value …; tools (generate, eval, serve, export, bench, launch, plan) take flags. "
        "`arbor COMMAND --help` for each."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArborParser)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    words = getattr(args, "trailing_words", None)     # a command whose free words may follow its options
    if extra and words and not any(e.startswith("-") for e in extra):
        getattr(args, words).extend(extra)    # words after options (`generate M "a" --max-tokens 5 "b"`)
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
