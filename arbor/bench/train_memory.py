"""Peak memory and step time of an SFT step at a real model's shape (`arbor bench train-memory`):
float32 against bf16 mixed precision (`train.dtype=bfloat16`, `arbor.train.precision`) and against
bf16 with LoRA adapters (`bfloat16+lora16`: `lora.rank=16` on the attention and MLP projections, the
frozen base stored in bf16; `arbor.train.lora`).

Each system runs in a child process of its own (so its peak RSS is its own): a Qwen3-shaped model
with random weights at `--hidden`, `--layers`, … (default: Qwen3-0.6B's shape, tied embeddings),
`--steps` SFT steps of `--tokens` tokens (random sequences of 512 tokens, one micro-batch) through
`arbor.train.sft.sft` with AdamW. Reported per system: median step time over the steps after the
first, and peak RSS (`ru_maxrss`) of the whole process: weights, gradients, AdamW moments,
activations, allocator slack.

Targets (issue 38): bf16 step time ≤ 0.8× float32's; bf16 + LoRA rank 16 peak ≤ 40 % of float32's.
"""

from __future__ import annotations

import json
import subprocess
import sys

from arbor.bench.common import median, print_table, print_targets, target, write_result

_CHILD = r'''
import json, resource, sys, time
import torch
from arbor.models import CausalLM, ModelConfig
from arbor.models.lora import LoRAConfig, apply_lora
from arbor.train.optim import OptimConfig
from arbor.train.sft import SFTConfig, sft
from arbor.train.tree_batch import TreeConfig
a = json.loads(sys.argv[1])
torch.manual_seed(0)
model = CausalLM(ModelConfig(hidden_size=a["hidden"], intermediate_size=a["intermediate"], num_hidden_layers=a["layers"],
                             num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"],
                             vocab_size=a["vocab"], tie_word_embeddings=True))
if a["lora"]:
    apply_lora(model, LoRAConfig(rank=a["lora"]), base_dtype=None if a["dtype"] == "float32" else getattr(torch, a["dtype"]))
g = torch.Generator().manual_seed(1)
examples = [(torch.randint(0, a["vocab"], (512,), generator=g).tolist(), [1] * 512) for _ in range(max(1, a["tokens"] // 512))]
stamps = [time.perf_counter()]
cfg = SFTConfig(steps=a["steps"], log_every=1, checkpoint_every=0, batch_tokens=a["tokens"], dtype=a["dtype"],
                tree=TreeConfig(enabled=False, token_cap=a["tokens"]), optim=OptimConfig(lr=1e-5, warmup_steps=0))
rows = sft(model, examples, cfg, on_log=lambda r: stamps.append(time.perf_counter()))
print(json.dumps({"step_s": [t1 - t0 for t0, t1 in zip(stamps, stamps[1:])], "loss": [r["loss"] for r in rows],
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "params": sum(p.numel() for p in model.parameters()),
                  "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))
'''


def add_arguments(p) -> None:
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per SFT step (one micro-batch)")
    p.add_argument("--steps", type=int, default=3, help="SFT steps per system (the first is not timed)")
    p.add_argument("--systems", default="float32,bfloat16,bfloat16+lora16",
                   help="training dtypes to run, comma-separated; DTYPE+loraR adds LoRA adapters of rank R")


def _system(name: str) -> tuple[str, int]:
    """"bfloat16+lora16" → ("bfloat16", 16); "float32" → ("float32", 0)."""
    dtype, _, lora = name.partition("+lora")
    if dtype not in ("float32", "bfloat16") or (lora and not lora.isdigit()) or lora == "0":
        raise ValueError(f"--systems: {name!r} is not DTYPE or DTYPE+loraR (DTYPE float32 or bfloat16, R ≥ 1)")
    return dtype, int(lora or 0)


def _run(args, name: str) -> dict:
    dtype, lora = _system(name)
    spec = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab",
                                          "tokens", "steps")} | {"dtype": dtype, "lora": lora}
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench train-memory: {name} failed: {r.stderr.strip()[-800:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(args) -> None:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        _system(s)
    results = {s: _run(args, s) for s in systems}
    for res in results.values():
        timed = res["step_s"][1:] or res["step_s"]
        res["median_step_s"] = median(timed)
    base = results.get("float32")
    rows = [[s, r["median_step_s"], r["peak_rss_gib"], r["median_step_s"] / base["median_step_s"] if base else "-",
             r["peak_rss_gib"] / base["peak_rss_gib"] if base else "-"] for s, r in results.items()]
    params = next(iter(results.values()))["params"]
    print_table(f"SFT step, {params / 1e9:.2f} B parameters, {args.tokens} tokens", ["system", "step s", "peak RSS GiB",
                                                                                    "step / float32", "RSS / float32"], rows)
    half = results.get("bfloat16")
    ratio = half["median_step_s"] / base["median_step_s"] if half and base else None
    lora = results.get("bfloat16+lora16")
    peak = lora["peak_rss_gib"] / base["peak_rss_gib"] if lora and base else None
    targets = [target("bf16 step time / float32's", ratio, "<= 0.8", ratio is not None and ratio <= 0.8),
               target("bf16 + LoRA rank 16 peak RSS / float32's", peak, "<= 0.4", peak is not None and peak <= 0.4)]
    print_targets(targets)

    def plot(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
        names = list(results)
        a.bar(names, [results[n]["median_step_s"] for n in names])
        a.set_ylabel("median SFT step (s)")
        b.bar(names, [results[n]["peak_rss_gib"] for n in names])
        b.set_ylabel("peak RSS (GiB)")
        return fig
    write_result(args.out, "train-memory", {"config": vars(args), "params": params, "results": results,
                                            "targets": targets}, plot)
