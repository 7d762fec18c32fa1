"""Forward + backward of one packed batch, Arbor vs transformers (``arbor bench model``).

Same weights in both (transformers' tensors loaded into Arbor by name), float32, a batch of
``batch × seq_len`` tokens with next-token cross-entropy; medians over interleaved repeats.
The ratio is Arbor's time ÷ transformers' time (≤ 1.0: Arbor is no slower).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from arbor.bench.common import median, print_table, print_targets, target, time_interleaved, write_result
from arbor.models import CausalLM, ModelConfig, VarlenAttention
from arbor.models.checkpoint import from_hf_tensors

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)


def build_pair(kind: str, device):
    import transformers as tf
    torch.manual_seed(0)
    if kind == "qwen3":
        hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**SHAPE))
    else:
        hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**SHAPE, **MOE))
    hf = hf.float().to(device).train()
    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
    with torch.device("meta"):
        arbor = CausalLM(cfg)
    arbor.load_state_dict(from_hf_tensors(dict(hf.state_dict()), arbor), assign=True)
    return hf, arbor.to(device).train()


def run(out_dir="bench_results", batch=4, seq_len=512, repeats=5, device="cpu", kinds=("qwen3", "qwen3_moe")):
    rows, result = [], {"config": {"batch": batch, "seq_len": seq_len, **SHAPE, "moe": MOE}, "systems": {}}
    for kind in kinds:
        hf, arbor = build_pair(kind, device)
        ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq_len), device=device,
                            generator=torch.Generator(device).manual_seed(0))
        labels = ids[:, 1:].reshape(-1)
        attn = VarlenAttention.from_lengths([seq_len] * batch, device=device)

        def step_hf():
            hf.zero_grad(set_to_none=True)
            logits = hf(ids).logits[:, :-1]
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels).backward()

        def step_arbor():
            arbor.zero_grad(set_to_none=True)
            logits = arbor.logits(arbor(ids.reshape(-1), attn).hidden).view(batch, seq_len, -1)[:, :-1]
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels).backward()

        times = time_interleaved({"transformers": step_hf, "arbor": step_arbor}, repeats, device=device)
        t_hf, t_arbor = median(times["transformers"]), median(times["arbor"])
        result["systems"][kind] = {"seconds": times, "median_s": {"transformers": t_hf, "arbor": t_arbor},
                                   "ratio_arbor_over_transformers": t_arbor / t_hf,
                                   "tokens_per_s": {"transformers": batch * seq_len / t_hf,
                                                    "arbor": batch * seq_len / t_arbor}}
        rows.append([kind, t_hf * 1e3, t_arbor * 1e3, t_arbor / t_hf])
    print_table(f"forward+backward, {batch}x{seq_len} tokens, float32, {device} (median of {repeats})",
                ["model", "transformers ms", "arbor ms", "arbor/transformers"], rows)
    result["targets"] = [target(f"{kind}: Arbor fwd+bwd time / transformers'", ratio, "<= 1.0", ratio <= 1.0)
                         for kind, _, _, ratio in rows]
    print_targets(result["targets"])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        names = [r[0] for r in rows]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="transformers")
        ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="arbor")
        ax.set_xticks(list(x), names)
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


def main(args) -> None:
    run(out_dir=args.out, batch=args.batch, seq_len=args.seq_len, repeats=args.repeats, device=args.device)
