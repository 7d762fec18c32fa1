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
from arbor.models.expert_parallel import is_expert_param, shard_experts

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
IGNORED_PREFIXES = ("mtp.",)


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the config; the message names the tensor."""


def _expert_ids(model, prefix: str, count: int) -> list[int]:
    """Logical ids of an Experts module's slots (all of them, or the rank's own under EP)."""
    return getattr(model.get_submodule(prefix), "expert_ids", None) or list(range(count))


def to_hf_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """Arbor state dict → HF-named tensors (experts split, a tied lm_head left out). Under expert
    parallelism: this rank's experts only, under their logical ids."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for j, e in enumerate(_expert_ids(model, prefix, t.shape[0])):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[j]
            else:
                gate, up = t[j].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return {k: v.contiguous() for k, v in out.items()}


def _shape(t) -> list[int]:
    return list(t.shape)


def from_hf_tensors(tensors: dict[str, torch.Tensor], model: CausalLM) -> dict[str, torch.Tensor]:
    """HF-named tensors → a complete Arbor state dict for ``model``, validated. Under expert
    parallelism the model's own experts are taken (``tensors`` may hold only those)."""
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
            fused = _FUSED.match(name)
            out[name] = t[_expert_ids(model, fused.group(1), t.shape[0])] if fused else t
        else:
            raise CheckpointError(f"unexpected tensor '{name}' {_shape(t)} in the checkpoint: the config "
                                  f"({model.config.architecture}, {model.config.num_hidden_layers} layers) has no such weight")
    for prefix, parts in experts.items():
        gu_name, down_name = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        if gu_name not in expected:
            name = f"{prefix}.{next(iter(parts))[0]}.gate_proj.weight"
            raise CheckpointError(f"unexpected tensor '{name}': layer '{prefix[:-12]}' is not an MoE layer in this config")
        num_e, (local, two_i, d) = model.config.num_experts, expected[gu_name].shape
        want = {"gate_proj": [two_i // 2, d], "up_proj": [two_i // 2, d], "down_proj": [d, two_i // 2]}
        for (e, kind), t in parts.items():
            if e >= num_e:
                raise CheckpointError(f"unexpected tensor '{prefix}.{e}.{kind}.weight': the config has {num_e} experts")
        mine = _expert_ids(model, prefix, local)
        for e in mine:
            for kind, shape in want.items():
                t = parts.get((e, kind))
                name = f"{prefix}.{e}.{kind}.weight"
                if t is None:
                    raise CheckpointError(f"missing tensor '{name}' (expected shape {shape})")
                if _shape(t) != shape:
                    raise CheckpointError(f"tensor '{name}' has shape {_shape(t)}, expected {shape}")
        out[gu_name] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in mine])
        out[down_name] = torch.stack([parts[(e, "down_proj")] for e in mine])
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


def read_tensors(folder: Path, device="cpu", keep=None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, or those whose name ``keep(name)`` accepts (the
    others are never read from disk)."""
    tensors = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt", device=str(device)) as h:
            for k in h.keys():
                if keep is None or keep(k):
                    tensors[k] = h.get_tensor(k)
    return tensors


def own_tensor_filter(model: CausalLM):
    """For an expert-parallel model: a ``keep`` that skips other ranks' per-expert tensors; else None."""
    mine = {name: set(m.expert_ids) for name, m in model.named_modules() if hasattr(m, "expert_ids")}
    if not mine:
        return None

    def keep(name: str) -> bool:
        m = _PER_EXPERT.match(name)
        return m is None or int(m.group(2)) in mine.get(m.group(1), ())
    return keep


def load_model(path: str | Path, dtype: torch.dtype | None = None, device="cpu", ctx=None) -> CausalLM:
    """Build the model a folder describes and load its weights (dtype: None keeps the file's).
    With a ``DistContext`` of ``ep_size`` > 1 the experts are sharded over its EP group and each rank
    reads only its own experts' tensors. A LoRA adapter folder (``arbor.models.lora``) loads as its
    base model with the adapter merged."""
    from arbor.models.lora import adapter_base, is_adapter_folder, merge_lora, read_adapter
    folder = Path(path)
    if is_adapter_folder(folder):
        model = load_model(adapter_base(folder), None, device, ctx)
        read_adapter(model, folder)
        model = merge_lora(model).requires_grad_(True)      # a plain model again, as a weights folder loads
        return (model.to(dtype) if dtype is not None else model).eval()
    cfg = ModelConfig.from_file(folder)
    model = CausalLM.on_meta(cfg)
    if ctx is not None and ctx.ep_size > 1:
        shard_experts(model, ctx)
    state = from_hf_tensors(read_tensors(folder, device, own_tensor_filter(model)), model)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def save_model(model: CausalLM, path: str | Path, tokenizer=None, max_shard_bytes: int = 4 << 30,
               tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write an HF-layout folder; shards (with an index) when the weights exceed max_shard_bytes.
    ``tensors``: the HF-named tensors to write (default ``to_hf_tensors(model)``; an expert-parallel
    model passes ``gather_hf_tensors``'s)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu() for k, v in (tensors if tensors is not None else to_hf_tensors(model)).items()}
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


def gather_hf_tensors(model, ctx) -> dict[str, torch.Tensor]:
    """The whole model's HF-named tensors (every expert of every EP rank), on every rank: what
    ``save_model`` writes as one ordinary folder. Collective: every rank must call it."""
    tensors = {k: v.detach().cpu() for k, v in to_hf_tensors(model).items()}
    if ctx.ep_size <= 1:
        return tensors
    experts = {k: v for k, v in tensors.items() if is_expert_param(k)}
    for part in ctx.all_gather_object(experts if ctx.rank < ctx.ep_size else {}, "gather experts for save"):
        tensors.update(part)
    return tensors


def export_model(src: str | Path, out: str | Path, merge: bool = False, dtype: torch.dtype | None = None) -> Path:
    """``arbor export``: write a plain HF folder at ``out`` from a model folder, a LoRA adapter folder
    (``merge``: the adapter folded into its base's weights) or a training checkpoint (its ``model``).
    Raises ValueError when ``out`` is not empty, or when ``merge`` does not match what ``src`` holds."""
    from arbor.models.lora import is_adapter_folder
    from arbor.models.tokenizer import Tokenizer
    src, out = Path(src), Path(out)
    if (src / "trainer.pt").is_file() and (src / "model").is_dir():      # a checkpoint (OUT/final, OUT/checkpoint)
        src = src / "model"
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; export into a new folder")
    adapter = is_adapter_folder(src)
    if adapter and not merge:
        raise ValueError(f"{src} is a LoRA adapter (PEFT format: peft loads it onto its base as it is); add --merge to "
                         "write a plain HF folder with the adapter merged into the base weights")
    if merge and not adapter:
        raise ValueError(f"{src} holds no LoRA adapter (adapter_config.json) to merge; drop --merge to export it as it is")
    model = load_model(src, dtype)
    tokenizer = Tokenizer.load(src) if (src / "tokenizer.json").is_file() else None
    return save_model(model, out, tokenizer=tokenizer)
