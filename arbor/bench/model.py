"""Forward + backward of one packed batch, Arbor vs transformers (``arbor bench model``).

Same random weights in both (transformers' tensors loaded into Arbor by name), a batch of
``batch × seq_len`` tokens with next-token cross-entropy, in float32, bfloat16 (parameters in bfloat16) and
``bfloat16-autocast`` (float32 parameters, forward and loss under bf16 autocast, backward after: what
``arbor train dtype=bfloat16`` and transformers' Trainer with ``bf16=True`` run) (``--dtype``); a fresh
batch of random tokens per step (so the routing, and each expert's row count, changes every step as in
training; both systems get the same batches); medians over interleaved repeats. Shapes: the tiny ``qwen3`` / ``qwen3_moe`` (hidden 256, 8 experts
top-2) and two at real MoE sparsity with equal active parameters, ``moe32`` (hidden 1024, 32 experts
top-4, expert intermediate 512) and ``moe64`` (hidden 1024, 64 experts top-8, expert intermediate 256),
each with ``MOE_LAYERS`` decoder layers. transformers runs its default ``experts_implementation``
(recorded in the JSON). Tiny shapes report Arbor's time ÷ transformers' (≤ 1.0: no slower); the
sparse shapes report transformers' time ÷ Arbor's (the speed-up), and moe64's Arbor time ÷ moe32's
(cost that falls with sparsity: at equal active parameters, ≤ 1.2).

Each system's rate is also given in GFLOP/s of the step's counted work (``step_flops``), beside
the best GEMM rate in the process at the step's own GEMM shapes (``gemm_rate``: torch's, or oneDNN's
float32 one; the larger of a hidden × hidden projection over all tokens and one expert's share of rows):
``speedup_bound`` = GEMM rate ÷ transformers' rate, the speed-up over transformers a step would reach if
all of it ran at the GEMM rate.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from arbor.bench.common import median, print_table, print_targets, target, time_interleaved, write_result
from arbor.kernels import fp32_gemm
from arbor.models import CausalLM, ModelConfig, VarlenAttention
from arbor.models.checkpoint import from_hf_tensors

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
MOE_LAYERS = 2
SPARSE = dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=MOE_LAYERS,
              num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
              norm_topk_prob=True)
SHAPES = {"qwen3": SHAPE, "qwen3_moe": SHAPE | MOE,
          "moe32": SPARSE | dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512),
          "moe64": SPARSE | dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bfloat16-autocast": torch.float32}
AUTOCAST = {"bfloat16-autocast": torch.bfloat16}      # parameters in DTYPES' dtype, forward under autocast


def step_flops(shape: dict, seq_len: int, seqs: int) -> float:
    """Forward + backward FLOPs of one step on ``seqs`` causal sequences of ``seq_len`` tokens: 3 × the
    forward's (backward: two GEMMs per forward GEMM). Forward per token, with D hidden, d head_dim,
    Hq / Hkv heads, S seq_len: Σ_layers [2·D·(2·Hq·d + 2·Hkv·d) (q, k, v, o) + 4·Hq·d·(S + 1)/2 (causal
    QKᵀ and PV over the mean context) + MLP] + 2·D·V (LM head); MLP = 6·D·I (SwiGLU) or, with E experts
    of I_e, top-k: 2·D·E + k·6·D·I_e. Norms, softmax, activations and routing copies are not counted."""
    D, d, L = shape["hidden_size"], shape["head_dim"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    if "num_experts" in shape:
        E, k, inter = shape["num_experts"], shape["num_experts_per_tok"], shape["moe_intermediate_size"]
        mlp = 2 * D * E + k * 6 * D * inter
    else:
        mlp = 6 * D * shape["intermediate_size"]
    per_token = L * (2 * D * (2 * q + 2 * kv) + 4 * q * (seq_len + 1) / 2 + mlp) + 2 * D * shape["vocab_size"]
    return 3 * per_token * seq_len * seqs


def gemm_rate(shape: dict, tokens: int, dtype, device, repeats: int = 9) -> float:
    """The best GEMM GFLOP/s in this process (median of ``repeats``; ``torch.mm``, and for float32 oneDNN's
    through ``fp32_gemm.mm``, which Arbor's float32 linears take: on AMD CPUs torch's float32 mm is MKL's AVX2
    code) at the step's shapes, the larger of: [tokens, D] × [D, D], and one expert's rows (tokens · k / E) ×
    [D, 2·I_e] (dense: [tokens, D] × [D, 2·I])."""
    D = shape["hidden_size"]
    if "num_experts" in shape:
        rows = max(1, tokens * shape["num_experts_per_tok"] // shape["num_experts"])
        width = 2 * shape["moe_intermediate_size"]
    else:
        rows, width = tokens, 2 * shape["intermediate_size"]
    best = 0.0
    for m, n in ((tokens, D), (rows, width)):
        a, b = torch.randn(m, D, device=device, dtype=dtype), torch.randn(D, n, device=device, dtype=dtype)
        systems = {"torch": lambda: a @ b}
        if dtype == torch.float32:             # other dtypes: fp32_gemm.mm is torch.mm
            systems["onednn"] = lambda: fp32_gemm.mm(a, b)
        times = time_interleaved(systems, repeats, device=device)
        best = max(best, *(2 * m * D * n / median(t) / 1e9 for t in times.values()))
    return best


def build_pair(kind: str, device, dtype=torch.float32):
    import transformers as tf
    torch.manual_seed(0)
    shape = SHAPES[kind]
    if "num_experts" not in shape:
        hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**shape))
    else:
        hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**shape))
    hf = hf.to(device, dtype).train()
    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
    with torch.device("meta"):
        arbor = CausalLM(cfg)
    arbor.load_state_dict(from_hf_tensors(dict(hf.state_dict()), arbor), assign=True)
    return hf, arbor.to(device).train()


def measure(kind: str, dtype: str, batch: int, seq_len: int, repeats: int, device) -> dict:
    hf, arbor = build_pair(kind, device, DTYPES[dtype])
    gen = torch.Generator(device).manual_seed(0)
    batches = [torch.randint(0, SHAPES[kind]["vocab_size"], (batch, seq_len), device=device, generator=gen)
               for _ in range(repeats + 1)]          # a fresh batch per step (warm-up, repeats), as in training
    attn = VarlenAttention.from_lengths([seq_len] * batch, device=device)
    steps = {"transformers": iter(batches), "arbor": iter(batches)}

    def loss(logits, ids):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    def forward():          # a trainer's mixed precision: forward and loss under autocast, backward after
        low = AUTOCAST.get(dtype)
        return torch.autocast(torch.device(device).type, dtype=low) if low else contextlib.nullcontext()

    def step_hf():
        ids = next(steps["transformers"])
        hf.zero_grad(set_to_none=True)
        with forward():
            value = loss(hf(ids).logits, ids)
        value.backward()

    def step_arbor():
        ids = next(steps["arbor"])
        arbor.zero_grad(set_to_none=True)
        with forward():
            value = loss(arbor.logits(arbor(ids.reshape(-1), attn).hidden).view(batch, seq_len, -1), ids)
        value.backward()

    times = time_interleaved({"transformers": step_hf, "arbor": step_arbor}, repeats, device=device)
    t_hf, t_arbor = median(times["transformers"]), median(times["arbor"])
    out = {"dtype": dtype, "seconds": times, "median_s": {"transformers": t_hf, "arbor": t_arbor},
           "ratio_arbor_over_transformers": t_arbor / t_hf, "speedup_over_transformers": t_hf / t_arbor,
           "tokens_per_s": {"transformers": batch * seq_len / t_hf, "arbor": batch * seq_len / t_arbor}}
    flops = step_flops(SHAPES[kind], seq_len, batch)
    rate = gemm_rate(SHAPES[kind], batch * seq_len, AUTOCAST.get(dtype, DTYPES[dtype]), device)
    per_s = {k: flops / t / 1e9 for k, t in out["median_s"].items()}
    out |= {"gflop_per_step": flops / 1e9, "gflop_per_s": per_s, "gemm_gflop_per_s": rate,
            "speedup_bound": rate / per_s["transformers"]}
    if "num_experts" in SHAPES[kind]:
        out["transformers_experts_implementation"] = hf.config._experts_implementation
    return out


def targets_of(systems: dict) -> list[dict]:
    out = []
    for key, s in systems.items():
        kind = key.split("/")[0]
        if kind in ("qwen3", "qwen3_moe"):
            r = s["ratio_arbor_over_transformers"]
            name = kind if s["dtype"] == "float32" else key      # the float32 names are the issue-1 targets
            out.append(target(f"{name}: Arbor fwd+bwd time / transformers'", r, "<= 1.0", r <= 1.0))
        else:
            x = s["speedup_over_transformers"]
            out.append(target(f"{key}: transformers fwd+bwd time / Arbor's", x, ">= 1.5", x >= 1.5))
    for dtype in DTYPES:
        a, b = systems.get(f"moe32/{dtype}"), systems.get(f"moe64/{dtype}")
        if a and b:
            r = b["median_s"]["arbor"] / a["median_s"]["arbor"]
            out.append(target(f"Arbor fwd+bwd, {dtype}: moe64 (64 experts top-8) time / moe32 (32 top-4)'s",
                              r, "<= 1.2", r <= 1.2))
    return out


def run(out_dir="bench_results", batch=4, seq_len=512, repeats=5, device="cpu", kinds=tuple(SHAPES),
        dtypes=tuple(DTYPES)):
    rows, result = [], {"config": {"batch": batch, "seq_len": seq_len, **SHAPE, "moe": MOE,
                                   "shapes": {k: SHAPES[k] for k in kinds}, "dtypes": list(dtypes)}, "systems": {}}
    for dtype in dtypes:
        for kind in kinds:
            key = kind if dtype == "float32" and kind in ("qwen3", "qwen3_moe") else f"{kind}/{dtype}"
            s = result["systems"][key] = measure(kind, dtype, batch, seq_len, repeats, device)
            rows.append([key, s["median_s"]["transformers"] * 1e3, s["median_s"]["arbor"] * 1e3,
                         s["speedup_over_transformers"]])
    print_table(f"forward+backward, {batch}x{seq_len} tokens, {device} (median of {repeats})",
                ["model", "transformers ms", "arbor ms", "transformers/arbor"], rows)
    result["targets"] = targets_of(result["systems"])
    print_targets(result["targets"])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(rows)), 3.5))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="transformers")
        ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="arbor")
        ax.set_xticks(list(x), [r[0] for r in rows], rotation=30, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("fwd+bwd time (ms, median)")
        ax.set_title(f"{batch}x{seq_len} tokens, {device}")
        ax.legend()
        return fig

    write_result(out_dir, "model", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))


def main(args) -> None:
    run(out_dir=args.out, batch=args.batch, seq_len=args.seq_len, repeats=args.repeats, device=args.device,
        kinds=tuple(args.shapes), dtypes=tuple(args.dtype))
