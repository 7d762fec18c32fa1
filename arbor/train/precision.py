"""Mixed-precision training: ``dtype=bfloat16`` (``train.dtype`` of ``arbor sft``, ``dtype`` of ``arbor train``).

The forward runs under ``torch.autocast`` in bfloat16 (so does its backward); parameters, gradients
and AdamW moments stay float32 (they are the master weights). Log-softmax and everything after it —
the log-probs, the losses, IcePop / TIS ratios — are float32 (autocast runs ``log_softmax`` in float32).
The rollout engine keeps its own dtype (``engine.dtype``), so a bf16 trainer against a float32 engine
is a real train/inference mismatch, which IcePop and TIS measure (``mismatch_abs``).

Why autocast and not bf16 parameters with a float32 master copy: one SFT step of a Qwen3-0.6B-shaped
model with 4 layers on 2048 tokens, Intel Xeon (AVX-512 BF16, AMX), 2 threads, medians of 3: float32
4.43 s, autocast 1.66 s, bf16 parameters + float32 master 1.81 s (and a second copy of the weights).
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(dtype: str, device) -> None:
    """ValueError naming the key's values, or why this device cannot train in ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "float16" and torch.device(device).type != "cuda":
        raise ValueError("dtype=float16 trains on CUDA only (a CPU has no float16 autocast worth using); "
                         "use bfloat16, which this CPU runs on its AVX-512 BF16 / AMX units where it has them")


def autocast(dtype: str, device):
    """The context a training forward runs in: bf16 / fp16 autocast, or nothing for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, dtype))


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when autocast left it in a 16-bit dtype; float32 and float64 as they are."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t
