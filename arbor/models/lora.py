"""LoRA adapters on a model's linear layers, saved and read in PEFT's format.

A targeted ``nn.Linear`` (weight W [out, in], frozen) becomes a ``LoRALinear`` with A [r, in] and
B [out, r] (the only trainable tensors):

    y = x Wᵀ + b + s · (drop(x) Aᵀ) Bᵀ,     s = alpha / r,

A drawn as PEFT draws it (``kaiming_uniform_(a=√5)``) and B = 0, so a fresh adapter changes nothing.
``merged_weight`` is W + s · B A (computed in float32 or wider, cast to W's dtype): the plain linear that
computes the same function without dropout. The module keeps its class's ``weight``/``bias`` names,
so the model's HF tensor names are unchanged; the adapter adds ``<module>.lora_A`` / ``lora_B``.

A target is named as PEFT names them: a module name (``q_proj``) matches every linear whose name is
it or ends with ``.q_proj``. Fused MoE experts are not ``nn.Linear`` and are never targets.

Folders (``save_adapter`` / ``read_adapter``) are what ``peft.PeftModel.from_pretrained`` loads:
``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules`` as the full
names adapted, ``base_model_name_or_path``) and ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_{A,B}.weight``. ``load_model`` reads such a folder as its base
with the adapter merged (``is_adapter_folder``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from arbor.kernels import fp32_gemm
from arbor.models.layers import Linear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    """The ``lora`` section of ``arbor sft`` / ``arbor train`` (rank 0: full fine-tuning)."""
    rank: int = 0                 # r: adapter rank (0: no adapters, every parameter trains)
    alpha: float = 16.0           # scaling s = alpha / rank
    dropout: float = 0.0          # dropout on the adapter's input while training
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))   # linear module names (PEFT's target_modules)

    def validate(self) -> None:
        from arbor.configs import check
        check(self, (self.rank >= 0, "rank", "must be ≥ 0 (0: no LoRA)"), (self.alpha > 0, "alpha", "must be > 0"),
              (0 <= self.dropout < 1, "dropout", "must be in [0, 1)"),
              (bool(self.targets) and all(isinstance(t, str) and t for t in self.targets), "targets",
               "must be a non-empty list of module names, e.g. [\"q_proj\", \"v_proj\"]"))

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LoRALinear(Linear):
    """A ``Linear`` with a low-rank update (module docstring); made by ``apply_lora`` in place."""
    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = fp32_gemm.linear(x, self.weight, self.bias)
        a = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        a = a.to(self.lora_A.dtype) if not torch.is_autocast_enabled(x.device.type) else a
        return base + (F.linear(F.linear(a, self.lora_A), self.lora_B) * self.scaling).to(base.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        wide = torch.promote_types(self.weight.dtype, torch.float32)      # float64 stays float64
        w = self.weight.to(wide) + self.scaling * (self.lora_B.to(wide) @ self.lora_A.to(wide))
        return w.to(self.weight.dtype)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]


def apply_lora(model: nn.Module, cfg: LoRAConfig, base_dtype: torch.dtype | None = None) -> list[str]:
    """Adapt ``cfg.targets`` in place (module docstring): every parameter is frozen, each target gets
    a trainable A, B in float32 (float64 for a float64 model); ``base_dtype`` recasts the frozen
    weights (bfloat16 halves them). → the full names adapted. Raises ValueError naming the linear
    modules that exist when a target matches none; the tied lm_head and experts are never adapted."""
    names = linear_names(model)
    missing = [t for t in cfg.targets if not any(_matches(n, t) for n in names)]
    if cfg.targets == DEFAULT_TARGETS and len(missing) < len(cfg.targets):
        missing = []            # the defaults adapt the projections a model has (an MoE model has no dense MLP)
    if missing:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"lora.targets {missing} name no linear module of this model; its linear modules are "
                         f"{kinds} (e.g. {names[0]})")
    for p in model.parameters():
        p.requires_grad_(False)
    if base_dtype is not None:
        model.to(base_dtype)
    adapted = [n for n in names if any(_matches(n, t) for t in cfg.targets)]
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and "lm_head" in adapted:
        raise ValueError("lora.targets names lm_head, which this model ties to its input embeddings; an adapter on it "
                         "would change the embeddings too — leave lm_head out of lora.targets")
    for n in adapted:
        m = model.get_submodule(n)
        adapter_dtype = torch.float64 if m.weight.dtype == torch.float64 else torch.float32
        a = torch.empty(cfg.rank, m.in_features, dtype=adapter_dtype, device=m.weight.device)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        m.__class__ = LoRALinear
        m.lora_A = nn.Parameter(a)
        m.lora_B = nn.Parameter(torch.zeros(m.out_features, cfg.rank, dtype=adapter_dtype, device=m.weight.device))
        m.scaling, m.lora_dropout = cfg.alpha / cfg.rank, cfg.dropout
    model.lora_config = cfg
    return adapted


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def merged_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``<module>.weight`` → W + s·B A of every adapted linear: what an engine serving the plain model
    needs at a weight sync (the other weights are frozen)."""
    return {f"{n}.weight": m.merged_weight() for n, m in lora_modules(model).items()}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and turn the module back into a plain ``Linear``."""
    for m in lora_modules(model).values():
        m.weight.data = m.merged_weight()
        del m.lora_A, m.lora_B
        m.__class__ = Linear
    model.__dict__.pop("lora_config", None)
    return model


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (``base_model.model.<module>.lora_A.weight``)."""
    out = {}
    for n, m in lora_modules(model).items():
        out[f"{PEFT_PREFIX}{n}.lora_A.weight"] = m.lora_A.detach().cpu().contiguous()
        out[f"{PEFT_PREFIX}{n}.lora_B.weight"] = m.lora_B.detach().cpu().contiguous()
    return out


def save_adapter(model: nn.Module, folder: str | Path, base: str | Path, tokenizer=None) -> Path:
    """Write a PEFT adapter folder (module docstring) of ``model``'s adapters over the base folder ``base``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg: LoRAConfig = model.lora_config
    save_file(adapter_tensors(model), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
              "lora_dropout": cfg.dropout, "target_modules": sorted(lora_modules(model)), "bias": "none",
              "base_model_name_or_path": str(Path(base).resolve()), "fan_in_fan_out": False,
              "inference_mode": True, "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
              "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
              "alpha_pattern": {}}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder


def is_adapter_folder(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file() and not (Path(folder) / "config.json").is_file()


def adapter_base(folder: str | Path) -> Path:
    """The base model folder an adapter folder names (``base_model_name_or_path``), checked to exist."""
    config = read_adapter_config(folder)
    base = Path(config.get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is a LoRA adapter over '{base}', which is not a model folder here; "
                                f"set base_model_name_or_path in {Path(folder) / ADAPTER_CONFIG} to the base model's folder")
    return base


def read_adapter_config(folder: str | Path) -> dict:
    config = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder}: only LoRA adapters are read (peft_type LORA), got {config.get('peft_type')!r}")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"{folder}: {key}=true adapters are not supported; save a plain LoRA adapter")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{folder}: per-module rank_pattern / alpha_pattern adapters are not supported")
    return config


def read_adapter(model: nn.Module, folder: str | Path) -> list[str]:
    """Apply the adapter saved in ``folder`` to ``model`` (a plain model of its base, or one with the
    same adapters, whose A, B are overwritten). → the modules adapted. Raises ValueError naming the
    tensor when the adapter does not fit the model."""
    config = read_adapter_config(folder)
    tensors = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    names = sorted({k[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0] for k in tensors if k.startswith(PEFT_PREFIX)})
    if not has_lora(model):
        rank = int(config["r"])
        apply_lora(model, LoRAConfig(rank=rank, alpha=float(config["lora_alpha"]), dropout=float(config.get("lora_dropout", 0)),
                                     targets=names), base_dtype=None)
    mods = lora_modules(model)
    if sorted(mods) != names:
        extra, lacking = sorted(set(names) - set(mods)), sorted(set(mods) - set(names))
        raise ValueError(f"{folder}: the adapter covers other modules than this model's adapters "
                         f"(only in the file: {extra[:3]}, only in the model: {lacking[:3]})")
    with torch.no_grad():
        for n, m in mods.items():
            for part in ("lora_A", "lora_B"):
                t = tensors[f"{PEFT_PREFIX}{n}.{part}.weight"]
                p = getattr(m, part)
                if t.shape != p.shape:
                    raise ValueError(f"{folder}: {n}.{part} has shape {tuple(t.shape)}, this model's is {tuple(p.shape)} "
                                     f"(another base model or rank?)")
                p.copy_(t)
    return names
