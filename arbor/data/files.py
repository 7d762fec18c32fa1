"""A user's dataset file → rows (plain dicts), read through HF ``datasets``.

Accepted: ``.jsonl`` / ``.json`` (JSON Lines, or one JSON array), ``.parquet``, ``.csv``, and a folder
written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose split is chosen
by ``split``, or is the only one). Every failure is a ValueError naming the config key (``what``), the
path and what is accepted; a file with no rows is one too.
"""

from __future__ import annotations

from pathlib import Path

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ACCEPTED = "a .jsonl, .json, .parquet or .csv file, or a folder saved by datasets' save_to_disk"


def load_rows(path: str, what: str = "data.train", split: str = "train") -> list[dict]:
    """The rows of ``path`` (module docstring), in file order."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{what}: no such file or folder: {path} (expected {ACCEPTED})")
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
