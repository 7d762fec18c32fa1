"""One config system: dataclasses, loaded from TOML, overridden by ``section.key=value`` words.

``load(cls, path, overrides)`` fills a (possibly nested) dataclass from a TOML file, then applies
each override; values are parsed as TOML literals (``lr=1e-5``, ``tree=false``, ``name="x"``),
falling back to the raw string. An unknown key is an error that lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set(obj, dotted: str, value: Any, origin: str) -> None:
    *path, last = dotted.split(".")
    for part in path:
        if not dataclasses.is_dataclass(getattr(obj, part, None)):
            raise KeyError(f"{origin}: '{dotted}': '{part}' is not a config section of {type(obj).__name__}")
        obj = getattr(obj, part)
    names = [f.name for f in dataclasses.fields(obj)]
    if last not in names:
        raise KeyError(f"{origin}: unknown key '{dotted}'; {type(obj).__name__} has {names}")
    hint = get_type_hints(type(obj)).get(last)
    if dataclasses.is_dataclass(getattr(obj, last)) and isinstance(value, dict):
        for k, v in value.items():
            _set(getattr(obj, last), k, v, origin)
        return
    if hint is float and isinstance(value, int):
        value = float(value)
    setattr(obj, last, value)


def load(cls, path: str | Path | None = None, overrides: list[str] = ()):
    cfg = cls()
    if path is not None:
        data = tomllib.loads(Path(path).read_text())
        for key, value in data.items():
            _set(cfg, key, value, str(path))
    for word in overrides:
        if "=" not in word:
            raise ValueError(f"override '{word}' must look like key=value (e.g. train.lr=1e-5)")
        key, text = word.split("=", 1)
        _set(cfg, key.strip(), parse_value(text.strip()), "command line")
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
