"""The memory plan of a training job, before step one (``arbor sft`` / ``arbor train`` preflight,
``arbor plan memory``).

Per rank, in bytes (P: parameters of the model, P_t of them trained, P_e expert parameters; E ranks
of expert parallelism hold P_e / E each; with FSDP, N data-parallel ranks split what is sharded):

- weights: frozen × bytes(base dtype: the training dtype with LoRA and 16-bit ``dtype``, else float32)
  + trained × 4 (float32 master weights; ÷ N with FSDP);
- gradients: P_t × 4; optimizer state (AdamW's two moments): P_t × 8 (each ÷ N with FSDP);
- autocast copies: with bf16/fp16 autocast on float32 weights, the 16-bit casts of the linear weights
  live through the forward: P_linear × 2;
- activations of the largest micro-batch of T tokens: T × a, with a the bytes autograd saves per
  token, measured on the model's own first ≤ 4 layers (random weights, its real widths, a 256-word
  vocabulary) as (saved(64 tokens) − saved(32 tokens)) / 32, scaled to all layers. With ``recompute``
  the stored part is the checkpointed layer inputs, plus one layer's activations rebuilt in backward;
- the log-prob head (``arbor.train.logprobs.head_bytes``): what ``gather_logprobs`` holds at its
  peak for T rows of a V-word vocabulary (fused, or the plain path under top-p or an adapted lm_head);
- the rollout engine (``arbor train``): its weights when it keeps its own copy, on CPU with its packed
  copies (``arbor.engine.cpu_linear``: one of every linear, one more for the few-row kernel, one of the
  experts), and its KV pool (``engine.num_blocks`` × the bytes of one block, or the pool its config
  resolves to);
- the reference model of a KL penalty: a copy of the weights;
- on CPU, the process's own memory before the model (Python, torch, the libraries), and the
  allocator's slack: the holes the heap keeps between freed blocks (``_allocator_slack``; none with
  ``ARBOR_MALLOC=lean``).

The peak (``peak_bytes``: gradients and activations do not peak together) is compared with what the device has free (CPU: ``MemAvailable``, shared by the ranks of
this host; CUDA: free device memory). Checked against measured peak RSS in
``arbor bench train-memory`` (its ``plan`` column).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

GIB = 1 << 30
PROBE_TOKENS = (32, 64)
PROBE_VOCAB = 256


class MemoryPlanError(ValueError):
    """The plan exceeds the device's free memory; the message names the largest items and their knobs."""


@dataclass
class PlanInputs:
    """What the plan reads from a job's config (``from_sft`` / ``from_rl``)."""
    model: object                  # ModelConfig
    dtype: str                     # the training compute dtype (float32 | bfloat16 | float16)
    lora_rank: int
    lora_targets: list[str]
    tokens: int                    # tokens of the largest micro-batch
    recompute: bool
    device: str = "cpu"
    world_size: int = 1
    local_ranks: int = 1           # ranks sharing this host's memory (CPU)
    ep_size: int = 1
    fsdp: bool = False
    engine: object | None = None   # EngineConfig of the colocated engine (arbor train)
    engine_shares: bool = False    # the engine serves the trainer's own tensors
    reference: bool = False        # a KL reference model is kept
    fused_head: bool = True        # the log-prob head runs fused (no top-k/top-p, lm_head not adapted)
    keys: dict = dataclasses.field(default_factory=dict)   # knob → the job's config key (train.dtype vs dtype)


def _layers(mcfg, k: int, vocab: int):
    return dataclasses.replace(mcfg, num_hidden_layers=k, layer_types=list(mcfg.layer_types[:k]), vocab_size=vocab,
                               mlp_only_layers=[i for i in mcfg.mlp_only_layers if i < k],
                               bos_token_id=None, eos_token_id=None, pad_token_id=None)


def parameter_counts(mcfg, lora_rank: int, targets: list[str]) -> dict[str, int]:
    """{"total", "trained", "expert", "linear"} parameter counts, from the model built on the meta device."""
    from arbor.models import CausalLM
    from arbor.models.expert_parallel import is_expert_param
    from arbor.models.lora import LoRAConfig, apply_lora
    model = CausalLM.on_meta(mcfg)
    if lora_rank:
        with torch.device("meta"):
            apply_lora(model, LoRAConfig(rank=lora_rank, targets=list(targets)))
    params = dict(model.named_parameters(remove_duplicate=True))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
                 and m.weight is not model.model.embed_tokens.weight)
    return {"total": sum(p.numel() for p in params.values()),
            "trained": sum(p.numel() for p in params.values() if p.requires_grad or not lora_rank),
            "expert": sum(p.numel() for n, p in params.items() if is_expert_param(n)), "linear": linear}


def _saved_bytes(model, tokens: int, dtype: str) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of ``tokens`` tokens
    (parameters excluded)."""
    from arbor.models import VarlenAttention
    from arbor.train.precision import autocast
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    ids = torch.randint(0, PROBE_VOCAB, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(dtype, "cpu"):
        model(ids, VarlenAttention.from_lengths([tokens])).hidden.float().sum()
    return sum(seen.values())


def activation_bytes_per_token(inp: PlanInputs) -> tuple[float, float]:
    """(bytes stored per token for backward over all layers, bytes of one layer's activations per
    token — rebuilt in backward under ``recompute``), measured as the module docstring says."""
    from arbor.models import CausalLM
    from arbor.models.lora import LoRAConfig, apply_lora
    mcfg = inp.model
    k = min(mcfg.num_hidden_layers, 4)
    torch.manual_seed(0)
    probe = CausalLM(_layers(mcfg, k, PROBE_VOCAB))
    if inp.lora_rank:
        apply_lora(probe, LoRAConfig(rank=inp.lora_rank, targets=list(inp.lora_targets)), base_dtype=_frozen(inp))

    def stored(recompute: bool) -> float:
        probe.gradient_checkpointing = recompute
        a, b = (_saved_bytes(probe, t, inp.dtype) for t in PROBE_TOKENS)
        return (b - a) / (PROBE_TOKENS[1] - PROBE_TOKENS[0]) * mcfg.num_hidden_layers / k

    full = stored(False)
    return (stored(True), full / mcfg.num_hidden_layers) if inp.recompute else (full, 0.0)


def _frozen(inp: PlanInputs):
    from arbor.models.lora import LoRAConfig
    from arbor.train.lora import frozen_dtype
    return frozen_dtype(LoRAConfig(rank=inp.lora_rank), inp.dtype)


def _host_ranks(inp: PlanInputs) -> int:
    """Ranks whose plans share one memory: those of this host on CPU, one per device on CUDA."""
    return inp.local_ranks if torch.device(inp.device).type == "cpu" else 1


def plan(inp: PlanInputs) -> list[tuple[str, int, str]]:
    """[(item, bytes per rank, the knobs that shrink it)] (module docstring)."""
    from arbor.train.logprobs import head_bytes
    k = inp.keys
    runtime = _own_rss() if torch.device(inp.device).type == "cpu" else 0     # before the probes below
    n = inp.world_size if inp.fsdp else 1
    counts = parameter_counts(inp.model, inp.lora_rank, inp.lora_targets)
    ep_share = counts["expert"] * (1 - 1 / max(1, inp.ep_size))
    total, trained = counts["total"] - ep_share, counts["trained"] - (0 if inp.lora_rank else ep_share)
    base = _frozen(inp)
    frozen_width = torch.finfo(base).bits // 8 if base else 4
    frozen_bytes = (total - trained) * frozen_width
    lora_knob = "lora.rank=16"
    items = [("weights", int(frozen_bytes + trained * 4 / n), f"{k.get('dtype', 'dtype')}=bfloat16 with {lora_knob}"),
             ("gradients", int(trained * 4 / n), f"{lora_knob}, dist.fsdp=true on more ranks"),
             ("optimizer state (AdamW)", int(trained * 8 / n), f"{lora_knob}, dist.fsdp=true on more ranks")]
    if inp.dtype != "float32" and not base:
        items.append(("autocast weight copies", int(counts["linear"] * 2), f"{lora_knob}"))
    stored, rebuilt = activation_bytes_per_token(inp)
    items.append((f"activations ({inp.tokens} tokens{', recompute' if inp.recompute else ''})",
                  int(inp.tokens * (stored + rebuilt)), f"recompute=true, a smaller {k.get('tokens', 'tree.token_cap')}"))
    if not inp.lora_rank or "lm_head" in inp.lora_targets:     # the head's weight gets its gradient first
        head = inp.model.vocab_size * inp.model.hidden_size
        items.append(("head gradient (part of the gradients)", int(head * 4 / n), ""))
    head_dtype = torch.float32 if inp.dtype == "float32" else getattr(torch, inp.dtype)
    items.append(("log-prob head", int(head_bytes(inp.tokens, inp.model.vocab_size, inp.model.hidden_size, head_dtype,
                                                  inp.fused_head)),
                  f"a smaller {k.get('tokens', 'tree.token_cap')}"))
    slack = _allocator_slack(inp, int(inp.tokens * (stored + rebuilt)), int(trained * 4 / n))
    if slack:
        items.append(("allocator slack (freed blocks the heap keeps)", slack, "ARBOR_MALLOC=lean (slower steps)"))
    if inp.engine is not None:
        from arbor.engine.kv.paged import KVCache
        e, mc = inp.engine, inp.model
        if not inp.engine_shares:
            size = torch.finfo(e.torch_dtype).bits // 8
            items.append(("engine weights", int(total * size), "engine.dtype=bfloat16"))
            if torch.device(e.device).type == "cpu" and (e.dtype == "bfloat16" or e.fp32_gemm == "onednn"):
                packed = counts["linear"] * (1 + e.few_row_kernel) + counts["expert"] - ep_share
                items.append(("engine's packed copies", int(packed * size),
                              "engine.few_row_kernel=false, engine.fp32_gemm=exact"))
        n_attn = sum(t == "full_attention" for t in mc.layer_types)
        per_block = KVCache.bytes_per_block(n_attn, e.block_size, mc.num_key_value_heads, mc.head_dim, e.torch_dtype)
        blocks = e.num_blocks if e.num_blocks is not None else min(
            e.max_num_seqs * -(-e.max_model_len // e.block_size), e.kv_cache_bytes // max(1, per_block))
        items.append(("engine KV cache", int(blocks * per_block), "engine.num_blocks, engine.kv_cache_bytes"))
    if inp.reference:
        items.append(("KL reference model", int(total * frozen_width),
                      "loss.kl_coef=0"))
    if runtime:
        items.append(("process (Python, torch, libraries)", runtime, ""))
    return items


def _allocator_slack(inp: PlanInputs, activations: int, gradients: int) -> int:
    """On CPU with ``ARBOR_MALLOC=tuned`` (or glibc's defaults) freed blocks stay in the heap: the holes a
    step's activations leave when backward frees them count in resident memory, less what the gradients,
    made during that same backward, fill again. Slack = max(0, activations − gradients). Measured at
    Qwen3-0.6B's shape, 2048 tokens (``arbor bench train-memory``, peak RSS tuned − lean, against
    activations − gradients): float32 3.0 against 4.5 GiB, bf16 2.1 against 2.5, bf16 + LoRA 2.3–2.8
    against 3.3 — the formula is the bound of those. ``lean`` returns freed blocks at once (0). CUDA's
    caching allocator is not modelled (0)."""
    from arbor.kernels.allocator import allocator_mode
    if torch.device(inp.device).type != "cpu" or allocator_mode() == "lean":
        return 0
    return max(0, activations - gradients)


def peak_bytes(items) -> int:
    """The plan's peak: every item at once, except that gradients and activations do not peak together —
    a step's largest moment is the start of backward, when every activation is held and the only
    gradient is the head's (``head gradient``); the other gradients are made as backward frees the
    activations. Peak = the rest + max(activations + head + head gradient, gradients)."""
    size = {name.split(" (")[0]: b for name, b, _ in items}
    overlapping = ("activations", "log-prob head", "head gradient", "gradients")
    rest = sum(b for name, b in size.items() if name not in overlapping)
    return rest + max(size.get("activations", 0) + size.get("log-prob head", 0) + size.get("head gradient", 0),
                      size.get("gradients", 0))


def _own_rss() -> int:
    """This process's resident memory now (before the model is built, it is the runtime's share)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb * 1024
    except (OSError, StopIteration):
        return 0


def available_bytes(device: str) -> int:
    """Free memory of ``device``: CUDA free device memory, or the host's MemAvailable."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def render(inp: PlanInputs, items, available: int) -> str:
    total, host = peak_bytes(items), _host_ranks(inp)
    width = max(len(name) for name, _, _ in items)
    lines = [f"memory plan per rank ({inp.world_size} rank(s), {inp.dtype}"
             f"{f', LoRA rank {inp.lora_rank}' if inp.lora_rank else ''}, {inp.device}):"]
    lines += [f"  {name.ljust(width)}  {b / GIB:8.2f} GiB   {knob}" for name, b, knob in items]
    lines.append(f"  {'peak'.ljust(width)}  {total / GIB:8.2f} GiB   (gradients and activations do not peak together)"
                 + (f"  × {host} ranks on this host" if host > 1 else ""))
    lines.append(f"  {'free on ' + inp.device.split(':')[0]:{width}}  {available / GIB:8.2f} GiB   "
                 f"{'fits' if total * host <= available else 'DOES NOT FIT'}")
    return "\n".join(lines)


def check(inp: PlanInputs, job: str, enforce: bool = True, show: bool = True) -> list:
    """Print the plan (``show``) and raise ``MemoryPlanError`` naming the largest items and their knobs
    when it exceeds the free memory (``enforce``). A job that fits only without the heap's slack switches
    this process to ``ARBOR_MALLOC=lean`` (unless the variable is set) and says so. → the items."""
    items = plan(inp)
    available = available_bytes(inp.device)
    host = _host_ranks(inp)
    lean = [it for it in items if not it[0].startswith("allocator slack")]
    if enforce and peak_bytes(items) * host > available >= peak_bytes(lean) * host and len(lean) < len(items):
        from arbor.kernels.allocator import switch_to_lean
        if switch_to_lean():
            items = lean
            if show:
                print(f"memory plan: {job} fits only if freed memory goes back to the system at once, so it runs "
                      "with ARBOR_MALLOC=lean (steps are slower; set ARBOR_MALLOC=tuned to keep the heap's slack)",
                      flush=True)
    if show:
        print(render(inp, items, available), flush=True)
    need = peak_bytes(items) * host
    if enforce and need > available:
        top = sorted(items, key=lambda it: -it[1])[:3]
        raise MemoryPlanError(
            f"{job} would need {need / GIB:.1f} GiB and {available / GIB:.1f} GiB are free, so it stops before step one. "
            "Largest: " + "; ".join(f"{n} {b / GIB:.1f} GiB ({knob})" if knob else f"{n} {b / GIB:.1f} GiB"
                                   for n, b, knob in top)
            + ". Set memory_check=false to run anyway (`arbor plan memory` prints the plan of any settings)")
    return items


def _model_config(model: str):
    from arbor.models import ModelConfig
    from arbor.models.presets import PRESETS, preset_config
    if model in PRESETS:
        from arbor.models.tokenizer import builtin_tokenizer
        return preset_config(model, builtin_tokenizer())
    return ModelConfig.from_file(model)


def _ranks(ranks: int | None) -> tuple[int, int]:
    """(world size, ranks on this host): ``ranks`` all on this host, or the launched job's (1, 1 outside
    ``arbor launch``)."""
    if ranks is not None:
        return ranks, ranks
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def from_sft(cfg, ranks: int | None = None) -> PlanInputs:
    """The plan's inputs of an ``arbor sft`` config (``SFTRunConfig``) on ``ranks`` ranks (default: this job's)."""
    world, local = _ranks(ranks)
    t = cfg.train
    tokens = min(t.tree.token_cap, t.batch_tokens) if t.tree.token_cap else t.batch_tokens
    mcfg = _model_config(cfg.model)
    return PlanInputs(model=mcfg, dtype=t.dtype, lora_rank=cfg.lora.rank,
                      fused_head=not (cfg.lora.rank and "lm_head" in cfg.lora.targets),
                      lora_targets=list(cfg.lora.targets), tokens=tokens, recompute=t.recompute, device=cfg.device,
                      world_size=world, local_ranks=local, ep_size=_ep(cfg, mcfg, world), fsdp=cfg.dist.fsdp,
                      keys={"dtype": "train.dtype", "tokens": "train.tree.token_cap", "recompute": "train.recompute"})


def from_rl(cfg, ranks: int | None = None) -> PlanInputs:
    """The plan's inputs of an ``arbor train`` config (``RLConfig``): the trainer plus its colocated engine,
    on ``ranks`` ranks (default: this job's)."""
    from arbor.train.config import engine_config, engine_shares
    world, local = _ranks(ranks)
    e = engine_config(cfg)
    mcfg = _model_config(cfg.model)
    shares = (not cfg.lora.enabled and not cfg.dist.fsdp and e.dtype == "float32" and cfg.dtype == "float32"
              and engine_shares(cfg, parameter_counts(mcfg, 0, [])["total"], world))
    tokens = cfg.tree.token_cap if cfg.tree.enabled and cfg.tree.token_cap else cfg.rollout.max_context
    return PlanInputs(model=mcfg, dtype=cfg.dtype, lora_rank=cfg.lora.rank, lora_targets=list(cfg.lora.targets),
                      tokens=tokens, recompute=cfg.recompute, device=cfg.device, world_size=world, local_ranks=local,
                      ep_size=_ep(cfg, mcfg, world), fsdp=cfg.dist.fsdp, engine=e, engine_shares=shares,
                      reference=cfg.loss.kl_coef > 0,
                      fused_head=cfg.rollout.top_p == 1 and not (cfg.lora.rank and "lm_head" in cfg.lora.targets))


def _ep(cfg, mcfg, world: int) -> int:
    return (cfg.dist.ep_size or world) if mcfg.num_experts and world > 1 else 1
