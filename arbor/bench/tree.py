"""Tree batches vs trajectory-wise training, forward + backward (``arbor bench tree``).

Generated agentic rollout trees: a shared system prompt + task (``prompt`` tokens), ``turns``
turns, each branching 2–4 ways into a model response (32–96 tokens) followed by a tool output
(32–128 tokens). Each tree is one GRPO group. Both systems compute the same RL loss
−Σ_j A_j · mean_t logp_jt over every trajectory and back-propagate it; the tree system runs one
packed forward per tree row (``arbor.train.tree_forward``), the baseline packs whole
trajectories (VarlenAttention) into micro-batches of ≤ ``token_cap`` tokens.

Ideal speedup = total tokens ÷ compact tokens (work without prefix recomputation); measured
speedup = median trajectory time ÷ median tree time, and "of fastest" = min ÷ min (robust on a
loaded shared machine). Attention work falls faster than tokens (Σ_j L_j² vs Σ_i depth_i), so the
measured value can exceed the token ideal on attention-heavy shapes. Memory: on
CUDA the peak of ``torch.cuda.max_memory_allocated``; on CPU the bytes of tensors autograd
saves for backward during the forward (``saved_tensors_hooks``, each storage once) — the
activation memory, which is what prefix compression and recomputation change. Per linear-attention
layer of the tree: ``linear_projected_tokens`` (= compact) rows pass its projections, conv and
out_proj, ``linear_rule_tokens_chunk64`` (compact + replayed) its gated delta rule.
"""

from __future__ import annotations

import torch

from arbor.bench.common import median, print_table, print_targets, sync, target, time_interleaved, write_result
from arbor.models import CausalLM, ModelConfig
from arbor.models.tree_linear import plan_linear
from arbor.train.tree_batch import TreeConfig, build_rows
from arbor.train.tree_forward import row_logprobs, trajectory_logprobs

SHAPE = dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192)
MODELS = {
    "dense": dict(architecture="Qwen3ForCausalLM", **SHAPE),
    "moe": dict(architecture="Qwen3MoeForCausalLM", **SHAPE, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=128, norm_topk_prob=True),
    "hybrid": dict(architecture="Qwen3NextForCausalLM", **SHAPE, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=128, shared_expert_intermediate_size=128, partial_rotary_factor=0.25,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32),
}


def agentic_tree(gen: torch.Generator, vocab: int, prompt: int = 320, turns: int = 3, branches=(2, 4),
                 response=(32, 96), tool=(32, 128)) -> list[list[int]]:
    """Trajectories (token lists) of one generated rollout tree."""
    rnd = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()
    between = lambda lo_hi: int(torch.randint(lo_hi[0], lo_hi[1] + 1, (), generator=gen))
    trajs = [rnd(prompt)]
    for _ in range(turns):
        trajs = [t + rnd(between(response)) + rnd(between(tool)) for t in trajs for _ in range(between(branches))]
    return trajs


def activation_bytes(fn) -> int:
    """Bytes of the storages autograd saves for backward while fn() runs (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def peak_memory(step, forward, device) -> int:
    if torch.device(device).type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    return activation_bytes(forward)


def run(out_dir="bench_results", trees=2, prompt=320, turns=3, repeats=3, token_cap=8192, device="cpu",
        kinds=("dense", "moe", "hybrid"), seed=0, threads=0, dense_mask=False):
    """dense_mask: also time the tree with the dense [T, T] ancestor mask (``TreeAttention``).
    threads: torch CPU threads (0 = leave torch's default)."""
    if threads:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    groups = [agentic_tree(gen, SHAPE["vocab_size"], prompt, turns) for _ in range(trees)]
    trajs = [t for g in groups for t in g]
    rows, n = build_rows(groups, token_cap)
    total, compact = sum(map(len, trajs)), sum(r.num_tokens for r in rows)
    ideal = total / compact
    adv = torch.randn(n, generator=gen).to(device)
    cfg = TreeConfig(token_cap=token_cap)
    stats = {"trees": trees, "trajectories": n, "total_tokens": total, "compact_tokens": compact,
             "ideal_speedup": ideal, "shared_prefix_ratio": 1 - compact / total, "rows": len(rows),
             "replayed_tokens_chunk64": sum(plan_linear(r.parents.tolist(), 64).replayed_tokens for r in rows)}
    # per linear-attention layer: the rule replays, the projections, conv and out_proj do not (arbor.models.tree_linear)
    stats.update(linear_rule_tokens_chunk64=compact + stats["replayed_tokens_chunk64"], linear_projected_tokens=compact)
    print(f"{n} trajectories in {trees} trees: {total} tokens, {compact} compact "
          f"(shared-prefix ratio {stats['shared_prefix_ratio']:.2f}, ideal speedup {ideal:.2f}x)")
    result = {"config": {"model_shape": SHAPE, "threads": torch.get_num_threads(), "dense_mask": dense_mask, "prompt": prompt, "turns": turns, "branches": [2, 4],
                         "response": [32, 96], "tool": [32, 128], "token_cap": token_cap, "repeats": repeats,
                         "memory": "cuda peak allocated" if device.startswith("cuda") else "saved activation bytes"},
              "trees": stats, "systems": {}}
    table = []
    for kind in kinds:
        torch.manual_seed(seed)
        model = CausalLM(ModelConfig(**MODELS[kind])).to(device).train()

        def loss_tree(cfg=cfg):
            loss = 0.0
            for row in rows:
                out = row_logprobs(model, row, cfg)
                loss = loss - sum(adv[j] * lp.mean() for j, lp in zip(row.traj_ids, out.per_trajectory))
            return loss

        def loss_traj():
            return -sum(a * lp.mean() for a, lp in zip(adv, trajectory_logprobs(model, trajs, token_cap)))

        def step(loss_fn):
            def go():
                model.zero_grad(set_to_none=True)
                loss_fn().backward()
            return go

        for recompute in (False, True):
            model.gradient_checkpointing = recompute
            systems = {"tree": step(loss_tree), "trajectory": step(loss_traj)}
            if dense_mask:
                dense_cfg = TreeConfig(token_cap=token_cap, attention="dense")
                systems["tree_dense_mask"] = step(lambda: loss_tree(dense_cfg))
            times = time_interleaved(systems, repeats, device=device)
            t_tree, t_traj = median(times["tree"]), median(times["trajectory"])
            mem = {name: peak_memory(step(fn), fn, device) for name, fn in (("tree", loss_tree), ("trajectory", loss_traj))}
            key = f"{kind}{'+recompute' if recompute else ''}"
            speedup = t_traj / t_tree
            best = min(times["trajectory"]) / min(times["tree"])  # fastest runs: least disturbed by load
            result["systems"][key] = {"seconds": times, "median_s": {k: median(v) for k, v in times.items()},
                                      "speedup": speedup, "speedup_over_ideal": speedup / ideal, "speedup_of_fastest": best,
                                      "memory_bytes": mem}
            table.append([key, t_traj * 1e3, t_tree * 1e3, speedup, best, ideal, speedup / ideal,
                          mem["trajectory"] / 2**20, mem["tree"] / 2**20]
                         + ([median(times["tree_dense_mask"]) * 1e3] if dense_mask else []))
    print_table(f"forward+backward, tree vs trajectory-wise, float32, {device} (median of {repeats})",
                ["model", "traj ms", "tree ms", "speedup", "of fastest", "ideal", "speedup/ideal", "traj MiB",
                 "tree MiB"]
                + (["tree dense-mask ms"] if dense_mask else []), table)
    result["targets"] = [target(f"{row[0]}: measured speedup / ideal", row[6], ">= 0.8", row[6] >= 0.8) for row in table]
    print_targets(result["targets"])

    def plot(plt):
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
        names = [r[0] for r in table]
        x = range(len(names))
        ax.bar(list(x), [r[3] for r in table], 0.6, label="measured")
        ax.axhline(ideal, color="k", ls="--", label=f"ideal {ideal:.2f}x")
        ax.axhline(0.8 * ideal, color="gray", ls=":", label="0.8 × ideal (target)")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("speedup (trajectory ÷ tree time)")
        ax.legend(fontsize=8)
        bx.bar([i - 0.2 for i in x], [r[7] for r in table], 0.4, label="trajectory-wise")
        bx.bar([i + 0.2 for i in x], [r[8] for r in table], 0.4, label="tree")
        bx.set_xticks(list(x), names, rotation=20)
        bx.set_ylabel("MiB (" + result["config"]["memory"] + ")")
        bx.legend(fontsize=8)
        fig.suptitle(f"{n} trajectories, {total} tokens → {compact} compact, {device}")
        return fig

    write_result(out_dir, "tree", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--trees", type=int, default=2)
    p.add_argument("--prompt", type=int, default=320, help="shared system prompt + task tokens")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--token-cap", type=int, default=8192)
    p.add_argument("--models", default="dense,moe,hybrid")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--dense-mask", action="store_true", help="also time the tree with a dense [T, T] mask")


def main(args) -> None:
    run(out_dir=args.out, trees=args.trees, prompt=args.prompt, turns=args.turns, repeats=args.repeats,
        token_cap=args.token_cap, device=args.device, kinds=tuple(args.models.split(",")), threads=args.threads,
        dense_mask=args.dense_mask)
