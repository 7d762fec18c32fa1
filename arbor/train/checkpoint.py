"""Resumable checkpoints of every trainer: crash-safe writes, verified reads, settings that must match.

``save_state`` / ``load_state`` write and read a folder: the model (HF layout), ``trainer.pt`` with
the optimizer state, torch's RNGs, the trainer's own state and the run's ``settings``.
``save_trainer`` / ``load_trainer`` do it for a trainer of the loop (``arbor.train.loop``): its
``step``, ``history``, ``settings`` and ``state_dict()``.

Invariants:
- at any moment ``folder`` or ``folder.tmp`` holds a complete checkpoint (see ``save_state``), so a
  process killed at any point, even mid-write, resumes from the last checkpoint written;
- a checkpoint is resumed only by a run of the same settings (``settings_of``: the config less
  ``RESUMABLE_CHANGES``) and the same number of ranks; otherwise the error names what differs and
  nothing is loaded;
- every file is checked against the sha256 recorded when it was written.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from arbor.distributed import DistContext
from arbor.train.fsdp import full_hf_tensors, is_fsdp, load_full_weights, local_optimizer_state, sharded_optimizer_state

RESUMABLE_CHANGES = ("steps", "log_every", "checkpoint_every", "device", "eval_every", "eval_problems", "resume", "out",
                     "timeout_s", "log", "eval", "memory_check")   # "eval": the eval section and data.eval


def save_state(folder: Path, model, optimizer, state: dict, tokenizer=None, ctx=None) -> None:
    """Write model + ``trainer.pt`` (optimizer, torch's CPU and CUDA RNGs, ``state``) to ``folder``.

    Crash-safe: the new checkpoint is written whole to ``folder.tmp`` (``trainer.pt`` last, by a
    rename), then the old one is invalidated (its ``trainer.pt`` removed first), deleted, and the new
    one renamed into place; at any moment ``folder`` or ``folder.tmp`` holds a complete checkpoint,
    which ``load_state`` finds.

    On several ranks (``ctx``; collective): the model is one ordinary HF folder (experts gathered),
    each rank's optimizer state, RNGs and ``state`` go to ``rank{r}.pt``, and rank 0 writes
    ``trainer.pt`` ({world_size, settings}) last and moves the folders. An expert-parallel model's
    per-layer expert placement is saved with each rank's state and re-applied by ``load_state``
    before the weights and the optimizer's slot-indexed moments are loaded (a migrated placement
    resumes as it was). A model with LoRA adapters saves (and resumes) the adapters alone, as a PEFT
    folder over its base. A sharded model (``dist.fsdp``) is written whole (its shards all-gathered), and
    each ``rank{r}.pt`` holds that rank's shards of the AdamW moments as plain tensors."""
    from arbor.models import save_model
    from arbor.models.lora import has_lora
    folder, ctx = Path(folder), ctx or DistContext.single()
    tmp = _tmp(folder)
    tensors, lora, sharded = None, has_lora(model), is_fsdp(model)
    if sharded:
        tensors = full_hf_tensors(model, ctx)
    elif ctx.ep_size > 1 and not lora:
        from arbor.models.checkpoint import gather_hf_tensors
        tensors = gather_hf_tensors(model, ctx)
    if ctx.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        if lora:            # the adapter only: the base is the run's frozen model folder (settings name it)
            from arbor.train.lora import save_adapter_folder
            save_adapter_folder(model, tmp / "model", tokenizer)
        else:
            save_model(model, tmp / "model", tokenizer=tokenizer, tensors=tensors)
    ctx.barrier("checkpoint: model written")
    optim = optimizer.state_dict()
    mine = {"optimizer": local_optimizer_state(optim) if sharded else optim, "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None, **state}
    placements = _placements(model)
    if placements:                    # expert slots (and the optimizer's slot-indexed moments) follow these
        mine["ep_placements"] = placements
    if ctx.distributed:
        torch.save(mine, tmp / f"rank{ctx.rank}.pt")
        ctx.barrier("checkpoint: rank states written")
        mine = {"settings": state["settings"], "world_size": ctx.world_size}
    if ctx.is_main:
        mine["checksums"] = _checksums(tmp)
        torch.save(mine, tmp / "trainer.part")
        (tmp / "trainer.part").rename(tmp / "trainer.pt")
        if folder.exists():
            (folder / "trainer.pt").unlink(missing_ok=True)
            shutil.rmtree(folder)
        tmp.rename(folder)
    ctx.barrier("checkpoint: moved into place")


def _placements(model) -> dict:
    """Each MoE layer's expert placement of an expert-parallel model ({} otherwise), as plain lists."""
    from arbor.models.expert_migration import placements_of
    return {m: {"rank_of": p.rank_of, "slot_of": p.slot_of, "ep_size": p.ep_size}
            for m, p in placements_of(model).items()}


def _tmp(folder: Path) -> Path:
    return folder.with_name(folder.name + ".tmp")


def _checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint but ``trainer.pt`` (which records them), by relative path."""
    import hashlib
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in ("trainer.pt", "trainer.part")):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[str(f.relative_to(folder))] = h.hexdigest()
    return out


def _verify(folder: Path, recorded: dict[str, str] | None) -> None:
    """Refuse a checkpoint whose files differ from what ``save_state`` wrote (corrupted, truncated,
    missing), naming the first such file. Checkpoints of older versions carry no checksums."""
    if recorded is None:
        return
    now = _checksums(folder)
    for name, digest in recorded.items():
        if now.get(name) != digest:
            what = "is missing" if name not in now else "is corrupted or truncated (its checksum differs from the one saved)"
            raise ValueError(f"{folder / name} {what}; delete {folder} to start over, or restore that file")


def _load(path: Path) -> dict:
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:   # a truncated or overwritten pickle raises anything from EOFError to UnpicklingError
        raise ValueError(f"cannot read {path} ({type(e).__name__}: {e}); the checkpoint is damaged — delete "
                         f"{path.parent} to start over") from None


def load_state(folder: Path, model, optimizer, settings: dict, ctx=None) -> dict | None:
    """Load ``save_state``'s model weights, optimizer state and torch RNGs; → the rest of the state, or
    None when ``folder`` holds no checkpoint. Raises, changing nothing, when the checkpoint's
    ``settings`` differ from ``settings`` (see ``settings_of``), it was written by another number of
    ranks, or it comes from an older layout. Collective on several ranks."""
    from arbor.models.checkpoint import from_hf_tensors, own_tensor_filter, read_tensors
    folder, ctx = Path(folder), ctx or DistContext.single()
    if ctx.is_main and not (folder / "trainer.pt").exists() and (_tmp(folder) / "trainer.pt").exists():
        if folder.exists():                       # save_state stopped between its last two moves
            shutil.rmtree(folder)
        _tmp(folder).rename(folder)
    ctx.barrier("checkpoint: find")
    if not (folder / "trainer.pt").exists():
        return None
    state = _load(folder / "trainer.pt")
    _verify(folder, state.pop("checksums", None))
    saved_world = state.get("world_size", 1)
    if saved_world != ctx.world_size:
        raise ValueError(f"{folder} holds a checkpoint written by {saved_world} rank(s) and this run has "
                         f"{ctx.world_size}; resume it with the same number of ranks (`arbor launch -n {saved_world} "
                         f"...`{' or without launch' if saved_world == 1 else ''}), or delete {folder} to start over")
    if ctx.distributed:
        state = {**_load(folder / f"rank{ctx.rank}.pt"), "settings": state["settings"]}
    missing = sorted({"optimizer", "torch_rng", "cuda_rng", "settings"} - state.keys())
    if missing:
        raise ValueError(f"{folder} holds a checkpoint that this version of Arbor cannot resume (it lacks "
                         f"{', '.join(missing)}); delete {folder} to start over")
    _check_same_settings(folder, state["settings"], settings)
    if state.get("ep_placements"):    # a migrated placement: relabel first, so weights and moments land in place
        from arbor.models.expert_migration import set_placement
        set_placement(model, state.pop("ep_placements"))
    from arbor.models.lora import has_lora, read_adapter
    if has_lora(model):
        read_adapter(model, folder / "model")
        weights = {n: p for n, p in model.named_parameters() if p.requires_grad}
    else:
        weights = from_hf_tensors(read_tensors(folder / "model", keep=own_tensor_filter(model)), model)
    bad = next((name for name, t in weights.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise ValueError(f"{folder / 'model'}: tensor '{bad}' holds NaN or inf values; this checkpoint cannot be "
                         f"resumed — delete {folder} (or restore an earlier one) to start over")
    optim = state.pop("optimizer")
    if is_fsdp(model):                # full weights: each rank keeps its rows; moments: this rank's shards
        load_full_weights(model, weights)
        optim = sharded_optimizer_state(optim, optimizer)
    elif not has_lora(model):
        model.load_state_dict(weights)
    optimizer.load_state_dict(optim)
    torch.set_rng_state(state.pop("torch_rng"))
    cuda_rng = state.pop("cuda_rng")
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_rng)
    return state


def settings_of(cfg) -> dict:
    """A config (dataclass) as plain JSON values, less the keys a resumed run may change (at any depth)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in RESUMABLE_CHANGES}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))


# Config keys added after checkpoints were written, with the value those runs had: a saved run without
# the key compares as having had it (resumable with that value; other values are named in the error).
ADDED_KEYS = {("loss", "agg"): "sequence"}


def _with_added_keys(saved: dict) -> dict:
    saved = json.loads(json.dumps(saved))
    for (*path, key), value in ADDED_KEYS.items():
        d = saved
        for k in path:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, dict):
            d.setdefault(key, value)
    return saved


def _check_same_settings(folder: Path, saved: dict, now: dict) -> None:
    saved = _with_added_keys(saved)
    diff = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    if diff:
        changes = ", ".join(f"{k}: {saved.get(k)!r} → {now.get(k)!r}" for k in diff)
        raise ValueError(f"{folder} holds a checkpoint of a run with other settings ({changes}); "
                         f"run with the same settings to resume it, or delete {folder} to start over")


def save_trainer(folder: Path, trainer) -> None:
    """``save_state`` of a loop trainer: model, optimizer, ``step``, ``history``, ``settings`` and the
    trainer's ``state_dict()`` (collective on several ranks)."""
    state = {"step": trainer.step, "history": trainer.history, **trainer.state_dict(), "settings": trainer.settings}
    save_state(folder, trainer.model, trainer.optimizer, state, tokenizer=trainer.tok, ctx=trainer.ctx)


def load_trainer(folder: Path, trainer) -> bool:
    """Resume ``trainer`` from ``folder`` (``load_state``, then ``trainer.load_state_dict`` of the rest);
    False, changing nothing, when ``folder`` holds no checkpoint."""
    state = load_state(folder, trainer.model, trainer.optimizer, trainer.settings, trainer.ctx)
    if state is None:
        return False
    trainer.step, trainer.history = state.pop("step"), state.pop("history")
    state.pop("settings")
    trainer.load_state_dict(state)
    return True
