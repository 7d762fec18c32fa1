"""LoRA in the trainers (``lora.rank`` of ``arbor sft`` and ``arbor train``; the adapters themselves
are ``arbor.models.lora``).

- Only the adapters train: the optimizer holds A and B (``make_optimizer`` takes parameters that
  require grad), so AdamW moments and gradients exist for them alone. With ``train.dtype`` /
  ``dtype`` 16-bit the frozen base weights are stored in that dtype (half of float32's memory).
- The base of an adapter is a model folder: the run's ``model`` when it is one, or, for a preset
  (random weights) or an adapter folder (merged on load), the plain model written to ``OUT/base``
  before adapting. Saving writes a PEFT adapter folder over that base.
- Rollouts use the current adapter merged: the RL engine keeps its own plain copy and each weight
  sync sends W + s·B A of the adapted linears only (``sync_tensors``). Measured against applying the
  adapter in the engine's forward in ``arbor bench lora``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from arbor.models.lora import LoRAConfig, apply_lora, has_lora, is_adapter_folder, merged_tensors, save_adapter


def frozen_dtype(lora: LoRAConfig, train_dtype: str) -> torch.dtype | None:
    """The dtype LoRA's frozen base is kept in: the training dtype when it is 16-bit, else None (as loaded)."""
    return getattr(torch, train_dtype) if lora.enabled and train_dtype in ("bfloat16", "float16") else None


def base_folder(model_arg: str, out: str | Path) -> tuple[Path, bool]:
    """(the folder an adapter over ``model_arg`` names as its base, whether the run must write it)."""
    p = Path(model_arg)
    if (p / "config.json").is_file() and not is_adapter_folder(p):
        return p, False
    return Path(out) / "base", True


def adapt(model, cfg: LoRAConfig, train_dtype: str, model_arg: str, out: str | Path, tokenizer, ctx) -> Path:
    """Write the base folder when needed (collective on several ranks), then adapt ``model`` in place
    (``apply_lora``; frozen weights in ``train_dtype`` when it is 16-bit). → the base folder."""
    from arbor.models import save_model
    base, write = base_folder(model_arg, out)
    if write:
        tensors = None
        if ctx.ep_size > 1:
            from arbor.models.checkpoint import gather_hf_tensors
            tensors = gather_hf_tensors(model, ctx)
        if ctx.is_main and not (base / "config.json").is_file():
            save_model(model, base, tokenizer=tokenizer, tensors=tensors)
        ctx.barrier("lora: base written")
    adapted = apply_lora(model, cfg, frozen_dtype(cfg, train_dtype))
    model.lora_base = str(base.resolve())
    if ctx.is_main:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"[lora] rank {cfg.rank}, alpha {cfg.alpha}: {len(adapted)} linear modules adapted "
              f"({', '.join(sorted({n.rsplit('.', 1)[-1] for n in adapted}))}); {trainable:,} of {total:,} parameters train ({100 * trainable / total:.2f} %); "
              f"base {base}", flush=True)
    return base


def save_adapter_folder(model, out: str | Path, tokenizer=None) -> Path:
    """The adapter of ``model`` as a PEFT folder at ``out`` (a full model's weights and config left
    there by an earlier run are removed, so that the folder reads as an adapter)."""
    out = Path(out)
    for old in [out / "config.json", *out.glob("model*.safetensors*")]:
        old.unlink(missing_ok=True)
    return save_adapter(model, out, model.lora_base, tokenizer)


def sync_tensors(model) -> dict[str, torch.Tensor]:
    """What a weight sync sends an engine holding its own plain copy: every parameter (a sharded model's
    gathered whole: collective), or with LoRA the merged weights of the adapted linears (nothing else
    changes)."""
    from arbor.train.fsdp import full_tensors, is_fsdp
    if is_fsdp(model):             # a sharded trainer (dist.fsdp): each tensor gathered whole as it is sent
        return full_tensors(model)
    return merged_tensors(model) if has_lora(model) else model.state_dict()
