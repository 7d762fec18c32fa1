"""HF-layout checkpoint folders: ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``), ``generation_config.json`` and the tokenizer files.

Tensor names are HF's. The only renaming is MoE experts: Arbor keeps each layer's experts fused
(``mlp.experts.gate_up_proj [E, 2I, D]``, ``mlp.experts.down_proj [E, D, I]``) while a checkpoint
holds ``mlp.experts.{e}.{gate,up,down}_proj.weight``; both layouts load. Keys of Qwen3-Next's
multi-token-prediction head (``mtp.*``) are ignored, as transformers does.

Invariant: every model tensor is set from exactly one checkpoint tensor of the expected shape;
anything missing, extra or mis-shaped raises ``CheckpointError`` naming the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from arbor.models.causal_lm import CausalLM
from arbor.models.config import ModelConfig

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
IGNORED_PREFIXES = ("mtp.",)


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the config; the message names the tensor."""


def to_hf_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """Arbor state dict → HF-named tensors (experts split, a tied lm_head left out)."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return {k: v.contiguous() for k, v in out.items()}


def _shape(t) -> list[int]:
    return list(t.shape)


def from_hf_tensors(tensors: dict[str, torch.Tensor], model: CausalLM) -> dict[str, torch.Tensor]:
    """HF-named tensors → a complete Arbor state dict for ``model``, validated."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    tensors = {k: v for k, v in tensors.items() if not k.startswith(IGNORED_PREFIXES)}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        elif name in expected:
            out[name] = t
        else:
            raise CheckpointError(f"unexpected tensor '{name}' {_shape(t)} in the checkpoint: the config "
                                  f"({model.config.architecture}, {model.config.num_hidden_layers} layers) has no such weight")
    for prefix, parts in experts.items():
        gu_name, down_name = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        if gu_name not in expected:
            name = f"{prefix}.{next(iter(parts))[0]}.gate_proj.weight"
            raise CheckpointError(f"unexpected tensor '{name}': layer '{prefix[:-12]}' is not an MoE layer in this config")
        num_e, two_i, d = expected[gu_name].shape
        want = {"gate_proj": [two_i // 2, d], "up_proj": [two_i // 2, d], "down_proj": [d, two_i // 2]}
        for (e, kind), t in parts.items():
            if e >= num_e:
                raise CheckpointError(f"unexpected tensor '{prefix}.{e}.{kind}.weight': the config has {num_e} experts")
        for e in range(num_e):
            for kind, shape in want.items():
                t = parts.get((e, kind))
                name = f"{prefix}.{e}.{kind}.weight"
                if t is None:
                    raise CheckpointError(f"missing tensor '{name}' (expected shape {shape})")
                if _shape(t) != shape:
                    raise CheckpointError(f"tensor '{name}' has shape {_shape(t)}, expected {shape}")
        out[gu_name] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num_e)])
        out[down_name] = torch.stack([parts[(e, "down_proj")] for e in range(num_e)])
    for name, ref in expected.items():
        if name not in out:
            raise CheckpointError(f"missing tensor '{name}' (expected shape {_shape(ref)})")
        if _shape(out[name]) != _shape(ref):
            raise CheckpointError(f"tensor '{name}' has shape {_shape(out[name])}, expected {_shape(ref)}")
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def read_tensors(folder: Path, device="cpu") -> dict[str, torch.Tensor]:
    tensors = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt", device=str(device)) as h:
            for k in h.keys():
                tensors[k] = h.get_tensor(k)
    return tensors


def load_model(path: str | Path, dtype: torch.dtype | None = None, device="cpu") -> CausalLM:
    """Build the model a folder describes and load its weights (dtype: None keeps the file's)."""
    folder = Path(path)
    cfg = ModelConfig.from_file(folder)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = from_hf_tensors(read_tensors(folder, device), model)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def save_model(model: CausalLM, path: str | Path, tokenizer=None, max_shard_bytes: int = 4 << 30) -> Path:
    """Write an HF-layout folder; shards (with an index) when the weights exceed max_shard_bytes."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu() for k, v in to_hf_tensors(model).items()}
    shards, size = [{}], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = model.config
    hf = cfg.to_hf()
    hf["dtype"] = str(model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    gen = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(cfg, k) is not None}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer is not None:
        tokenizer.save(folder)
    return folder
