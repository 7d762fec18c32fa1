"""One config system: dataclasses, loaded from TOML, overridden by ``section.key=value`` words.

``load(cls, path, overrides)`` fills a (possibly nested) dataclass from a TOML file, then applies
each override; values are parsed as TOML literals (``lr=1e-5``, ``tree.enabled=false``,
``name="x"``), falling back to the raw string. Every value is checked where it enters: an unknown
key is an error that lists the valid ones (or, for a key a section renamed — its class's
``RENAMED_KEYS`` — names the new key), a value of the wrong type (``steps=2.5``, ``tree=false``
for a section) names the key and the type it wants, and after loading every section's
``validate()`` (ranges, allowed names; see ``check``) runs, its error prefixed with the section's
dotted path. Nothing runs on a config that failed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
import types
import typing
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


def _set(root, dotted: str, value: Any, origin: str) -> None:
    """Set ``dotted`` (a key path from ``root``) to ``value``; a dict value sets a section's keys."""
    *path, last = dotted.split(".")
    obj = root
    for part in path:
        if not dataclasses.is_dataclass(getattr(obj, part, None)):
            _refuse_renamed(root, dotted, origin)
            raise KeyError(f"{origin}: '{dotted}': '{part}' is not a config section of {type(obj).__name__}")
        obj = getattr(obj, part)
    names = [f.name for f in dataclasses.fields(obj)]
    if last not in names:
        _refuse_renamed(root, dotted, origin)
        raise KeyError(f"{origin}: unknown key '{dotted}'; {type(obj).__name__} has {names}")
    hint = get_type_hints(type(obj)).get(last)
    if dataclasses.is_dataclass(getattr(obj, last)):
        short = getattr(type(getattr(obj, last)), "SHORTHAND", None)    # ``agent=x`` sets ``agent.<SHORTHAND>``
        if short is not None and not isinstance(value, dict):
            value = {short: value}
        if not isinstance(value, dict):
            keys = [f.name for f in dataclasses.fields(getattr(obj, last))]
            raise ValueError(f"{origin}: '{dotted}' is a config section, not a value; set its keys "
                             f"({', '.join(f'{dotted}.{k}' for k in keys)})")
        for k, v in value.items():
            _set(root, f"{dotted}.{k}", v, origin)
        return
    setattr(obj, last, _typed(value, hint, f"{origin}: '{dotted}'"))


def _refuse_renamed(root, dotted: str, origin: str) -> None:
    """KeyError naming the new key when ``dotted`` is a key that a section along its path renamed
    (its class's ``RENAMED_KEYS``: old key path relative to the section → new one)."""
    parts, obj = dotted.split("."), root
    for i in range(len(parts)):
        new = getattr(type(obj), "RENAMED_KEYS", {}).get(".".join(parts[i:]))
        if new is not None:
            new = ".".join([*parts[:i], new])
            raise KeyError(f"{origin}: '{dotted}' was renamed to '{new}' (e.g. {new}=…)")
        obj = getattr(obj, parts[i], None)
        if not dataclasses.is_dataclass(obj):
            return


def _typed(value, hint, where: str):
    """``value`` as ``hint`` wants it (an int is a float; a list is a tuple), or ValueError."""
    if hint is None or hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _typed(value, arg, where)
            except ValueError:
                pass
        raise ValueError(f"{where} must be {_name(hint)}, got {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise ValueError(f"{where} must be {_name(hint)}, got {value!r}")
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        inner = args[0] if args and (origin is list or (len(args) == 2 and args[1] is Ellipsis)) else None
        items = [_typed(v, inner if inner is not None else (args[i] if i < len(args) else None), where)
                 for i, v in enumerate(value)]
        if origin is tuple and args and args[-1] is not Ellipsis and len(items) != len(args):
            raise ValueError(f"{where} must be {_name(hint)}, got {value!r}")
        return items if origin is list else tuple(items)
    check_type = origin or hint
    if isinstance(check_type, type) and not isinstance(value, check_type):
        raise ValueError(f"{where} must be {_name(hint)}, got {value!r}")
    return value


def _name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check(cfg, *rules) -> None:
    """For ``validate()`` methods: rules are (condition, field name, what it must be); the first
    failing one raises ValueError('FIELD must …, got VALUE')."""
    for ok, name, why in rules:
        if not ok:
            raise ValueError(f"{name} {why}, got {getattr(cfg, name)!r}")


def validate(cfg, path: str = "") -> None:
    """Run every (nested) section's ``validate()``; errors are prefixed with the section's path."""
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub):
            validate(sub, f"{path}{f.name}.")
    if hasattr(cfg, "validate"):
        try:
            cfg.validate()
        except ValueError as e:      # a section may name itself ("EngineConfig.dtype …"): the path replaces that
            message = str(e).removeprefix(f"{type(cfg).__name__}.") if path else str(e)
            raise ValueError(f"{path}{message}" if path else message) from None


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
    validate(cfg)
    return cfg


def describe(cls, prefix: str = "", obj=None) -> list[tuple[str, str, str]]:
    """(dotted key, default, one-line doc) for every key of a config dataclass, nested sections
    included with the defaults their parent gives them (``obj``: the instance whose values to show);
    the doc is the field's trailing ``# comment`` in the class source."""
    import inspect
    import re
    try:
        docs = dict(re.findall(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", inspect.getsource(cls), re.M))
    except (OSError, TypeError):
        docs = {}
    obj, out = cls() if obj is None else obj, []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += describe(type(value), f"{prefix}{f.name}.", value)
        else:
            out.append((f"{prefix}{f.name}", repr(value), docs.get(f.name, "").strip()))
    return out


def help_text(cls) -> str:
    """The keys of a job's config for ``arbor JOB --help``."""
    rows = describe(cls)
    width = max(len(f"{k}={d}") for k, d, _ in rows)
    return "keys (key=value; defaults shown):\n" + "\n".join(
        f"  {f'{k}={d}':<{width}}  {doc}".rstrip() for k, d, doc in rows)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
