"""The ``arbor`` command. Each subcommand is registered by one small ``add_*`` function listed in
``SUBCOMMANDS``; handlers call library code and hold no logic a library user would need.

Benchmarks: ``arbor bench NAME`` — every module ``arbor.bench.NAME`` listed in ``BENCHMARKS``
defines ``add_arguments(parser)`` and ``main(args)``; add a name there to register one.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = ["model"]


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark program (prints a ratio table, writes JSON + PNG)")
    bench = p.add_subparsers(dest="bench", required=True)
    for name in BENCHMARKS:
        module = importlib.import_module(f"arbor.bench.{name}")
        b = bench.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        b.add_argument("--out", default="bench_results", help="folder for NAME.json and NAME.png")
        b.add_argument("--device", default="cpu")
        module.add_arguments(b)
        b.set_defaults(func=module.main)


SUBCOMMANDS = [add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arbor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"arbor {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
