"""A user's dataset file → rows (plain dicts), read through HF ``datasets``.

Accepted: ``.jsonl`` / ``.json`` (JSON Lines, or one JSON array), ``.parquet``, ``.csv``, and a folder
written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose split is chosen
by ``split``, or is the only one). Every failure is a ValueError naming the config key (``what``), the
path and what is accepted; a file with no rows is one too.

A ``.jsonl`` file of flat rows — every line an object with the same keys, each column of one scalar
type (str, bool, finite float, or int in int64) — is read with ``json`` instead (``plain_jsonl``): for
such rows ``datasets`` returns exactly these dicts, and importing it costs ~0.6 s of every start.
Anything else (nested values, nulls, missing keys, mixed types: what ``datasets`` unifies) goes through
``datasets``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ACCEPTED = "a .jsonl, .json, .parquet or .csv file, or a folder saved by datasets' save_to_disk"


def plain_jsonl(path: Path) -> list[dict] | None:
    """The rows of a JSON Lines file of flat rows (module docstring), or None when it is not one."""
    rows, scalar = [], (str, bool, float, int)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
        for line in lines[:-1] if lines[-1] == "" else lines:
            rows.append(json.loads(line))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not rows or not all(type(r) is dict for r in rows):
        return None
    types = {k: type(v) for k, v in rows[0].items()}
    for r in rows:
        if list(r) != list(types):          # datasets gives every row the first row's column order
            return None
        for k, v in r.items():
            if type(v) is not types[k] or types[k] not in scalar or \
                    (type(v) is float and not math.isfinite(v)) or (type(v) is int and not -2 ** 63 <= v < 2 ** 63):
                return None
    return rows


def load_rows(path: str, what: str = "data.train", split: str = "train") -> list[dict]:
    """The rows of ``path`` (module docstring), in file order."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{what}: no such file or folder: {path} (expected {ACCEPTED})")
    if p.is_file() and p.suffix.lower() == ".jsonl" and p.stat().st_size and (rows := plain_jsonl(p)) is not None:
        return rows
    import datasets

    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    if p.is_dir():
        if not any((p / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise ValueError(f"{what}: {path} is a folder but not one saved by datasets' save_to_disk "
                             f"(no dataset_info.json / dataset_dict.json); expected {ACCEPTED}")
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            names = list(ds)
            pick = split if split in ds else (names[0] if len(names) == 1 else None)
            if pick is None:
                raise ValueError(f"{what}: {path} holds the splits {names} and none is '{split}'; "
                                 f"save the split you mean on its own, or name it '{split}'")
            ds = ds[pick]
    else:
        fmt = FORMATS.get(p.suffix.lower())
        if fmt is None:
            raise ValueError(f"{what}: unknown format '{p.suffix or p.name}' of {path}; expected {ACCEPTED}")
        if p.stat().st_size == 0:
            raise ValueError(f"{what}: {path} is empty (no rows)")
        try:
            ds = datasets.load_dataset(fmt, data_files=str(p.resolve()), split="train")
        except Exception as e:
            why = (str(e).strip().splitlines() or [""])[0][:300]
            raise ValueError(f"{what}: cannot read {path} as {fmt}: {type(e).__name__}: {why}") from e
    rows = ds.to_list()
    if not rows:
        raise ValueError(f"{what}: {path} has no rows")
    return rows


def require_column(rows: list[dict], key: str, what: str, path: str) -> None:
    """ValueError naming ``key`` (the config key ``what``) and the columns ``rows`` do have."""
    if rows and key not in rows[0]:
        raise ValueError(f"{what}={key!r}: {path} has no column {key!r}; its columns are {sorted(rows[0])}")
