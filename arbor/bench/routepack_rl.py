"""RoutePack inside ``arbor train``: the RL update on 2 EP ranks, RoutePack vs Karmarkar–Karp + static
experts, on the same recorded samples (``arbor bench routepack-rl``).

A random-weight Qwen3-MoE model (``--hidden``, ``--experts``, ``--top-k``, ``--moe-intermediate``,
``--layers``; the built-in tokenizer's vocabulary) is
saved as a model folder; 2 ranks × 1 thread (``routepack_rl_worker``) each build ``arbor train``'s
``RLTrainer`` twice from it, once with ``plan.routepack=true`` and once with ``plan.layout=kk`` (experts
stay contiguous), and roll out ``--warmup + --windows`` steps of the ``longtail`` task (long-tailed
response lengths, the engine's expert ids recorded for routing replay) at θ_0 with one engine. Then
both trainers train every recorded step (a window: its ``mini_batches`` optimizer steps), interleaved,
``--repeats`` times. A step's time is the slowest rank's ``RLTrainer._learn``: advantages, the layout
(gathering the samples, planning, RoutePack's expert migration with the AdamW moments), θ_old's pass and
the optimizer steps — everything the trainer spends between rollout and weight sync.

A random router routes nearly uniformly (the busiest of 16 experts ≈ 1.1× the mean load), unlike a
trained MoE's; ``--router-skew s`` (default 1) scales each layer's router rows by Zipf factors
(r + 1)^−s in a random expert order per layer, which makes the busiest expert ≈ 3.4× the mean at s = 1
(≈ 2.5× at s = 0.5; isotropic inputs); the rollouts, and so the replayed routing, are recorded from that model.

Tokens/s per window = the step's tokens ÷ its median seconds over the repeats; the figure is the median
over the measured windows of RoutePack's ÷ KK's, with its min–max spread. The cost model RoutePack plans
with comes from ``--cost-file`` or is calibrated now (``arbor.bench.plan_cost``).

Target (issue 39): RoutePack ÷ KK + static ≥ 1.10 in trainer tokens/s (recorded longtail rollouts,
2 EP ranks), the median over the measured windows (≥ 5 by default: 6).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from arbor.bench.common import add_moe_shape_arguments, median, print_table, target, write_result
from arbor.bench.plan_cost import bench_cost_model

MARK = "ROUTEPACK_RL_RESULT "
METHODS = {"KK + static": ["plan.layout=kk"], "RoutePack": ["plan.routepack=true"]}


def model_folder(path: Path, hidden: int, experts: int, top_k: int, moe_intermediate: int, layers: int,
                 seed: int, router_skew: float = 0.0) -> dict:
    """A random-weight Qwen3-MoE folder with the built-in tokenizer; → the shape (ModelConfig fields).
    ``router_skew`` s > 0: each MoE layer's router row of expert e is scaled by (r_e + 1)^−s / mean, r a
    random order of the experts per layer, so some experts are routed far more often (module docstring)."""
    import torch

    from arbor.models import CausalLM, ModelConfig, save_model
    from arbor.models.tokenizer import builtin_tokenizer
    tok = builtin_tokenizer()
    heads = max(1, hidden // 64)
    shape = dict(architecture="Qwen3MoeForCausalLM", vocab_size=tok.vocab_size, hidden_size=hidden,
                 intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=max(1, heads // 2), head_dim=64, num_experts=experts,
                 num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate, norm_topk_prob=True)
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**shape, eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        for layer in model.model.layers:
            if router_skew and hasattr(layer.mlp, "gate"):
                f = (torch.randperm(experts).double() + 1) ** -router_skew
                layer.mlp.gate.weight.mul_((f / f.mean()).float()[:, None])
    save_model(model, path, tokenizer=tok)
    return shape


def run(out_dir="bench_results", shape_args=None, windows=6, warmup=1, repeats=2, groups=8, branch=4,
        max_tokens=256, token_cap=1024, mini_batches=2, cost_file=None, seed=0, timeout_s=1800.0,
        router_skew=1.0, plan_window=4) -> dict:
    from arbor.distributed.launch import launch
    a = shape_args or {}
    with tempfile.TemporaryDirectory(prefix="arbor-routepack-rl-") as tmp:
        shape = model_folder(Path(tmp) / "model", a.get("hidden", 512), a.get("experts", 16), a.get("top_k", 2),
                             a.get("moe_intermediate", 512), a.get("layers", 4), seed, router_skew)
        cost, cost_path = bench_cost_model(shape, token_cap, out_dir, cost_file, timeout_s)
        common = [f"model={Path(tmp) / 'model'}", "task=longtail", f"seed={seed}", f"groups_per_step={groups}",
                  f"rollout.branch=[{branch}]", f"rollout.max_turn_tokens={max_tokens}",
                  f"rollout.max_context={max_tokens + 96}", "c3po.enabled=false", "tree.enabled=false",
                  f"tree.token_cap={token_cap}", f"plan.window={plan_window}", f"mini_batches={mini_batches}",
                  "checkpoint_every=0",
                  f"plan.cost_file={json.dumps(str(cost_path))}", f"out={Path(tmp) / 'out'}"]
        spec = {"model": str(Path(tmp) / "model"), "common": common, "methods": METHODS, "windows": windows,
                "warmup": warmup, "repeats": repeats, "timeout_s": min(timeout_s, 600.0)}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        res = launch([sys.executable, "-m", "arbor.bench.routepack_rl_worker", str(Path(tmp) / "spec.json")], 2,
                     threads=1, timeout_s=timeout_s, echo=None)
        lines = [line for out in res.output for line in out if line.startswith(MARK)]
        if res.returncode or not lines:
            tails = "\n".join(line for out in res.output for line in out[-30:])
            raise RuntimeError("routepack-rl ranks failed:\n" + tails)
    got = json.loads(lines[0][len(MARK):])
    measured = range(got["warmup"], len(got["tokens"]))
    step_s = {m: [median(got["seconds"][m][k]) for k in measured] for m in METHODS}   # median of the repeats
    tps = {m: [got["tokens"][k] / t for k, t in zip(measured, step_s[m])] for m in METHODS}
    ratio = [r / k for r, k in zip(tps["RoutePack"], tps["KK + static"])]
    stats = {m: {key: median([s[key] for k in measured for s in got["stats"][m][k] if key in s])
                 for key in {key for k in measured for s in got["stats"][m][k] for key in s}} for m in METHODS}
    rows = [[k, got["tokens"][k]] + [f"{step_s[m][i]:.3f}" for m in METHODS] + [f"{ratio[i]:.3f}"]
            for i, k in enumerate(measured)]
    print_table("RL update on 2 EP ranks (seconds: slowest rank, median of repeats)",
                ["step", "tokens", *METHODS, "RoutePack / KK tokens/s"], rows)
    keys = sorted({k for m in METHODS for k in stats[m]})
    print_table("per step, median (seconds unless named)", ["figure", *METHODS],
                [[k] + [f"{stats[m][k]:.4g}" if k in stats[m] else "–" for m in METHODS] for k in keys])
    value = median(ratio)
    result = {"benchmark": "routepack-rl",
              "config": {"shape": shape, "windows": windows, "warmup": warmup, "repeats": repeats, "groups": groups,
                         "branch": branch, "max_tokens": max_tokens, "token_cap": token_cap,
                         "mini_batches": mini_batches, "seed": seed, "router_skew": router_skew,
                         "plan_window": plan_window, "threads": got["threads"], "ranks": 2,
                         "cost_model": {"a": cost.a, "b": cost.b, "e": cost.e, "c0": cost.c0, "move_s": cost.move_s,
                                        "move_layer_s": cost.move_layer_s}},
              "tokens": [got["tokens"][k] for k in measured],
              "step_s": step_s,
              "tokens_per_s": {m: median(v) for m, v in tps.items()}, "ratio_per_window": ratio,
              "ratio_median": value, "ratio_min": min(ratio), "ratio_max": max(ratio), "stats": stats,
              "targets": [target("trainer tokens/s, RoutePack / KK + static", value, ">= 1.10", value >= 1.10)]}

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for m in METHODS:
            ax.plot(list(measured), tps[m], "o-", label=m)
        ax.set_xlabel("recorded step (window)")
        ax.set_ylabel("trainer tokens/s (2 EP ranks)")
        ax.set_title(f"RoutePack / KK + static: median {value:.3f} ({min(ratio):.3f}–{max(ratio):.3f})")
        ax.legend()
        return fig

    write_result(out_dir, "routepack-rl", result, plot)
    return result


def add_arguments(p) -> None:
    add_moe_shape_arguments(p)
    p.add_argument("--windows", type=int, default=6, help="recorded steps measured (each a window of optimizer steps)")
    p.add_argument("--warmup", type=int, default=1, help="recorded steps trained first and not measured")
    p.add_argument("--repeats", type=int, default=2, help="times every step is trained by each method")
    p.add_argument("--groups", type=int, default=8, help="groups per step and rank (groups_per_step)")
    p.add_argument("--branch", type=int, default=4, help="samples per group")
    p.add_argument("--max-tokens", type=int, default=256, help="longest response (rollout.max_turn_tokens)")
    p.add_argument("--token-cap", type=int, default=1024, help="tokens per micro-batch (tree.token_cap)")
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per RL step (the window)")
    p.add_argument("--cost-file", help="cost model JSON (arbor plan calibrate --ep); default: calibrate now")
    p.add_argument("--router-skew", type=float, default=1.0,
                   help="Zipf exponent of the experts' router scales (0: the random router, near-uniform routing)")
    p.add_argument("--plan-window", type=int, default=4, help="RoutePack re-places experts every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed to the ranks")


def main(args) -> None:
    for name in ("windows", "repeats", "groups", "branch", "max_tokens", "token_cap", "mini_batches", "plan_window"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.vocab != 2048:
        raise ValueError("--vocab does not apply here: the model folder takes the built-in tokenizer's vocabulary")
    if not (args.router_skew >= 0 and args.router_skew < float("inf")):
        raise ValueError(f"--router-skew must be a finite number ≥ 0, got {args.router_skew}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be ≥ 0, got {args.warmup}")
    shape = {k: getattr(args, k) for k in ("hidden", "experts", "top_k", "moe_intermediate", "layers")}
    run(out_dir=args.out, shape_args=shape, windows=args.windows, warmup=args.warmup, repeats=args.repeats,
        groups=args.groups, branch=args.branch, max_tokens=args.max_tokens, token_cap=args.token_cap,
        mini_batches=args.mini_batches, cost_file=args.cost_file, seed=args.seed, timeout_s=args.timeout,
        router_skew=args.router_skew, plan_window=args.plan_window)
