"""Rollout makespan of an agentic workload under each engine policy (``arbor bench makespan``).

The workload: N trajectories × K turns; first prompts of ``--prompt-tokens`` (256–2,048) tokens,
after every turn a tool call whose latency is log-normal (median ``--tool-median-ms``, σ
``--tool-sigma``) and whose output (``--tool-tokens``, 64–1,024 tokens) is appended to the history
as a continuation prefill; outputs of ``--output-tokens`` (16–128) tokens, greedy, EOS ignored, so
every policy computes the same tokens (checked). Configurations, each in its own child processes
(``arbor.bench.makespan_worker``, hard timeout): 1 rank dense and 1 rank MoE on 1 core, 1 rank MoE
on 2 cores, 2 ranks MoE with EP = 2 on 1 core each (attention data-parallel: each rank drives half
the trajectories). Policies, interleaved over ``--repeats`` rounds: ``prefill-first`` and ``mixed``
(one executor with all the rank's cores), ``pd-global-enqueue`` and ``pd-multiplex``
(``arbor.engine.policies.pd_multiplex``: a prefill and a decode worker running concurrently with
``--pd-threads`` cores each, decode steps admitted at the epoch start only, or at every segment
boundary too). On the 1-core configurations the two workers share one core.

Reported per configuration and policy: makespan (median over repeats; on N ranks the ranks finish
together), p50/p99 TTFT of continuation prefills, decode stall (Σ over decode tokens of the time
from a token's sampling to the start of the forward that consumes it, per decode token), generated
tokens/s; a PNG with makespan per policy and the P / D timeline of each rank (2 ranks, last repeat).
Targets (issue 39; 1 rank × 2 cores and 2 ranks, EP = 2, each where run): ``pd-multiplex`` makespan
≥ 10 % below ``prefill-first`` and ≥ 5 % below ``pd-global-enqueue`` (medians); its ratio to ``mixed``
and its p99-TTFT ratio to ``prefill-first`` reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from arbor.bench.common import median, print_table, print_targets, target, write_result
from arbor.bench.makespan_worker import MARK
from arbor.distributed.launch import launch

POLICIES = ["prefill-first", "mixed", "pd-global-enqueue", "pd-multiplex"]
CONFIGS = {"1 rank dense": (1, False, 1), "1 rank MoE": (1, True, 1), "1 rank MoE x 2 cores": (1, True, 2),
           "2 ranks MoE (EP=2)": (2, True, 1)}     # name → (ranks, MoE, cores per rank)
TARGETED = ("1 rank MoE x 2 cores", "2 ranks MoE (EP=2)")


def _span(text: str, lo: int = 1) -> list[int]:
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a range LO-HI of integers, got '{text}'") from None
    if not lo <= a <= b:
        raise argparse.ArgumentTypeError(f"range '{text}' must satisfy {lo} <= LO <= HI")
    return [a, b]


def add_arguments(p) -> None:
    p.add_argument("--trajectories", type=int, default=16, help="trajectories in all (split over the ranks)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-tokens", type=_span, default=[256, 2048], metavar="LO-HI")
    p.add_argument("--tool-tokens", type=_span, default=[64, 1024], metavar="LO-HI")
    p.add_argument("--output-tokens", type=_span, default=[16, 128], metavar="LO-HI")
    p.add_argument("--tool-median-ms", type=float, default=1000.0, help="median tool latency (sandboxed code, search: ~1 s)")
    p.add_argument("--tool-sigma", type=float, default=0.5, help="σ of the log-normal tool latency")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--pd-segment-layers", type=int, default=1)
    p.add_argument("--pd-threads", default="1,1", help="P,D: cores of the prefill and decode workers (pd-* policies)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration before its ranks are killed")


def model_shape(a, moe: bool) -> dict:
    heads = max(2, a.hidden // 64)
    shape = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                 num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=a.hidden // heads,
                 max_position_embeddings=8192)
    if moe:
        shape.update(architecture="Qwen3MoeForCausalLM", num_experts=a.experts, num_experts_per_tok=2,
                     moe_intermediate_size=a.hidden, norm_topk_prob=True)
    return shape


def check(a) -> list[str]:
    for name in ("trajectories", "turns", "hidden", "layers", "experts", "vocab", "max_num_batched_tokens",
                 "pd_segment_layers", "repeats"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.tool_median_ms < 0 or a.tool_sigma < 0:
        raise ValueError("--tool-median-ms and --tool-sigma must be >= 0")
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    longest = a.prompt_tokens[1] + a.turns * (a.output_tokens[1] + a.tool_tokens[1])
    if longest > 8192:
        raise ValueError(f"a trajectory may reach {longest} tokens, more than the 8192-token context; shorten it")
    from arbor.engine.policies.pd_runtime import parse_pd_threads
    try:
        parse_pd_threads(a.pd_threads)
    except ValueError as e:
        raise ValueError(f"--pd-threads: {e}") from None
    return configs


def run_config(a, name: str) -> dict:
    ranks, moe, cores = CONFIGS[name]
    if ranks > 1 and a.trajectories < ranks:
        raise ValueError(f"--trajectories must be >= {ranks} for '{name}'")
    spec = dict(model=model_shape(a, moe), seed=a.seed, trajectories=a.trajectories, turns=a.turns,
                prompt_tokens=a.prompt_tokens, tool_tokens=a.tool_tokens, output_tokens=a.output_tokens,
                tool_median_s=a.tool_median_ms / 1e3, tool_sigma=a.tool_sigma, policies=POLICIES, repeats=a.repeats,
                max_num_batched_tokens=a.max_num_batched_tokens, pd_segment_layers=a.pd_segment_layers,
                pd_threads=a.pd_threads, max_model_len=8192, timeout_s=60.0)
    t0 = time.perf_counter()
    res = launch([sys.executable, "-m", "arbor.bench.makespan_worker", json.dumps(spec)], ranks, cores,
                 timeout_s=a.timeout, echo=None)
    tails = "\n".join(f"--- rank {r} ---\n" + "\n".join(lines[-25:]) for r, lines in enumerate(res.output))
    found = [[line[len(MARK):] for line in lines if line.startswith(MARK)] for lines in res.output]
    if res.returncode or not all(found):
        raise RuntimeError(f"bench makespan: '{name}' failed (exit codes {res.codes})\n{tails}")
    per_rank = [json.loads(f[-1])["results"] for f in found]
    print(f"  {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return summarize(per_rank)


def summarize(per_rank: list[dict]) -> dict:
    """Per policy: each repeat's makespan = the slowest rank's; TTFTs and stalls pooled over ranks."""
    out = {}
    for policy in POLICIES:
        runs = [r[policy] for r in per_rank]             # [rank][repeat]
        makespans = [max(rep) for rep in zip(*([x["makespan_s"] for x in rank] for rank in runs))]
        last = [rank[-1] for rank in runs]
        cont = [t for rank in runs for x in rank for t in x["ttft_continuation_s"]]
        decode_tokens = sum(x["decode_tokens"] for rank in runs for x in rank)
        generated = sum(x["generated_tokens"] for x in last)
        out[policy] = {
            "makespan_s": makespans, "median_makespan_s": median(makespans),
            "ttft_continuation_p50_s": float(np.percentile(cont, 50)) if cont else None,
            "ttft_continuation_p99_s": float(np.percentile(cont, 99)) if cont else None,
            "decode_stall_ms_per_token": 1e3 * sum(x["decode_stall_s"] for rank in runs for x in rank) / max(1, decode_tokens),
            "tokens_per_s": generated / median(makespans),
            "outputs_crc": [x["outputs_crc"] for x in last],
            "boundary_decode_steps": [x["boundary_decode_steps"] for x in last],
            "timeline": [x["timeline"] for x in last]}
    crcs = {p: out[p]["outputs_crc"] for p in POLICIES}
    out["same_outputs"] = all(c == crcs[POLICIES[0]] for c in crcs.values())
    return out


def main(a) -> dict:
    configs = check(a)
    print(f"bench makespan: {a.trajectories} trajectories x {a.turns} turns, prompts {a.prompt_tokens}, tool outputs "
          f"{a.tool_tokens}, outputs {a.output_tokens} tokens, tool latency median {a.tool_median_ms:.0f} ms; "
          f"policies {', '.join(POLICIES)}; {a.repeats} repeat(s)", flush=True)
    results = {name: run_config(a, name) for name in configs}
    rows = []
    for name, res in results.items():
        base = res["prefill-first"]["median_makespan_s"]
        for p in POLICIES:
            r = res[p]
            rows.append([name, p, r["median_makespan_s"], r["median_makespan_s"] / base, r["ttft_continuation_p50_s"],
                         r["ttft_continuation_p99_s"], r["decode_stall_ms_per_token"], r["tokens_per_s"]])
    print_table("makespan (medians; ratio = makespan / prefill-first's)",
                ["config", "policy", "makespan s", "ratio", "TTFT p50 s", "TTFT p99 s", "stall ms/tok", "tok/s"], rows)
    targets, reported = [], {}
    for name in (n for n in TARGETED if n in results):
        res = results[name]
        m = {p: res[p]["median_makespan_s"] for p in POLICIES}
        cut_pf, cut_ge = 1 - m["pd-multiplex"] / m["prefill-first"], 1 - m["pd-multiplex"] / m["pd-global-enqueue"]
        targets += [target(f"pd-multiplex makespan below prefill-first ({name})", cut_pf, ">= 0.10", cut_pf >= 0.10),
                    target(f"pd-multiplex makespan below pd-global-enqueue ({name})", cut_ge, ">= 0.05", cut_ge >= 0.05)]
        reported[name] = {"pd_multiplex_over_mixed": m["pd-multiplex"] / m["mixed"],
                          "pd_multiplex_p99_ttft_over_prefill_first": res["pd-multiplex"]["ttft_continuation_p99_s"]
                          / res["prefill-first"]["ttft_continuation_p99_s"]}
        print(f"reported ({name}): " + ", ".join(f"{k} {v:.3f}" for k, v in reported[name].items()))
    if targets:
        print_targets(targets)
    for name, res in results.items():
        if not res["same_outputs"]:
            raise RuntimeError(f"bench makespan: the policies generated different tokens in '{name}'")
    args = {k: v for k, v in vars(a).items() if k not in ("func", "bench", "args", "command")}
    write_result(a.out, "makespan", {"args": args, "results": results, "targets": targets, "reported": reported},
                 lambda plt: plot(plt, results))
    return None


def plot(plt, results: dict):
    name = next((n for n in reversed(TARGETED) if n in results), None)
    two = results.get(name)
    fig, axes = plt.subplots(1, 3 if two else 1, figsize=(16 if two else 6, 4.5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(POLICIES)
    for j, p in enumerate(POLICIES):
        ax.bar([i + j * width for i in range(len(results))], [r[p]["median_makespan_s"] for r in results.values()],
               width, label=p)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], list(results), fontsize=8)
    ax.set_ylabel("makespan (s, median)")
    ax.legend(fontsize=8)
    colours = {"prefill": "tab:blue", "decode": "tab:orange", "mixed": "tab:purple"}
    for ax, p in zip(axes[0][1:], ("prefill-first", "pd-multiplex")):
        for rank, timeline in enumerate(two[p]["timeline"] if two else []):
            for phase, t0, t1, _ in timeline:
                row = rank * 2 + (phase == "decode")
                ax.broken_barh([(t0, t1 - t0)], (row - 0.4, 0.8), color=colours.get(phase, "grey"))
        ranks = len(two[p]["timeline"]) if two else 0
        ax.set_yticks(range(2 * ranks), [f"rank {r} {x}" for r in range(ranks) for x in "PD"])
        ax.set_xlabel("seconds")
        ax.set_title(f"{p}: makespan {two[p]['median_makespan_s']:.1f} s ({name})", fontsize=9)
    return fig
