"""Pieces every subcommand module shares: the job parser and how short flags become config words."""

from __future__ import annotations

import argparse
import importlib


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


def job_parser(sub, name: str, help: str, config: str):
    """A job subcommand: ``arbor NAME [cfg.toml] [key=value …]``; its --help lists every key."""
    p = sub.add_parser(name, help=help, description=help, config=config,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=50 loss.correction=tis")
    return p


def split_config(args):
    """argparse puts a leading key=value into ``config``; move it to the overrides."""
    if args.config and "=" in args.config and not args.config.endswith(".toml"):
        return None, [args.config, *args.overrides]
    return args.config, args.overrides


def flag_words(a, keys: dict) -> list[str]:
    """key=value words for the short flags given (``keys``: attribute → config key); strings as TOML strings."""
    import json
    return [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for attr, k in keys.items()
            if (v := getattr(a, attr)) is not None]
