"""The config reference (docs/config.md), generated from the job config dataclasses.

``python -m arbor.cli.reference [PATH]`` writes it (default ``docs/config.md``); ``reference_text()``
is what it writes: for every subcommand that takes a config (``arbor NAME --help`` lists the same
keys), each dotted key with its default and the trailing ``# comment`` of its field.
``tests/test_config_reference.py`` fails when the committed file differs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

DEFAULT_PATH = Path("docs/config.md")


def _config_commands() -> list[tuple[str, str, type]]:
    """(command, description, config class) for each subcommand of ``arbor`` built with a config."""
    from arbor.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for name, parser in sub.choices.items():
        if getattr(parser, "config", None):
            module, cls = parser.config.split(":")
            out.append((name, parser.description or "", getattr(importlib.import_module(module), cls)))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_text() -> str:
    from arbor import configs
    lines = ["# Config reference", "",
             "Generated from the config dataclasses by `python -m arbor.cli.reference` (do not edit by hand).",
             "Every job takes `arbor COMMAND [cfg.toml] [key=value …]`: a TOML file whose tables are the sections",
             "below, then `key=value` overrides (dotted keys reach into sections). An unknown or renamed key is",
             "refused with its name. `arbor COMMAND --help` prints the same list.", ""]
    for name, description, cls in _config_commands():
        lines += [f"## `arbor {name}` ({cls.__module__}.{cls.__name__})", "", description, "",
                  "| key | default | meaning |", "| --- | --- | --- |"]
        lines += [f"| `{k}` | `{_cell(d)}` | {_cell(doc)} |" for k, d, doc in configs.describe(cls)]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    path = Path((argv if argv is not None else sys.argv[1:])[0]) if (argv or sys.argv[1:]) else DEFAULT_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reference_text())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
