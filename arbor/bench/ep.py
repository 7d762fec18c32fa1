"""Expert parallelism: N ranks × 1 thread (EP = N) vs 1 rank × N threads (``arbor bench ep``).

Qwen3-MoE shape where the experts hold most of the weights (default: hidden 512, 16 experts top-2,
expert width 512, 4 layers, vocab 2048; random weights from fixed seeds). Two configurations do the
same global work, each in child processes started by ``arbor.distributed.launch`` (``arbor.bench.ep_worker``)
under a hard timeout:
- ``single``: 1 rank × N threads holds the whole model and the whole batch;
- ``ep``: N ranks × 1 thread, each holding 1/N of every MoE layer's experts (``shard_experts``);
  attention, embeddings and head are data-parallel (rank r takes the r-th N-th of the sequences).
Workloads, each in its own processes (so peak memory is the workload's own):
- ``train``: one step = forward + backward (loss summed over the rank's tokens ÷ global tokens) +
  non-expert gradient all-reduce (``arbor.train.distributed.reduce_gradients``) + AdamW, on a packed
  batch of ``batch × seq_len`` tokens; a step's time is the slowest rank's.
- ``decode``: ``LLMEngine`` greedy generation, EOS ignored, of ``prompts × new_tokens`` (each rank
  its share of the prompts, lockstep steps); decode tokens/s = prompts·(new_tokens − 1) ÷ the time
  after the first (prefill) step.
Reported: tokens/s of both and their ratio (EP ÷ single), the share of the EP ranks' step time spent
inside ``all_to_all_single`` (the EP counts and rows exchanges, waiting on the peer included), peak
RSS per rank (``getrusage``), expert parameter bytes per rank measured on the live model ÷ the whole
model's, and checks that both do the same computation (first-step loss, generated tokens).
Targets: EP train tokens/s ≥ 0.8 × single; expert memory per rank = 1/EP of the total ± 10 %.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

from arbor.bench.common import add_moe_shape_arguments, median, print_table, write_result
from arbor.distributed.launch import launch
from arbor.models.presets import moe_shape as model_shape

MIB = 1 << 20
MARK = "EP_RESULT "     # a rank's result line: MARK + json


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, of this process and its waited-for children), or None
    off Linux."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")     # minus idle and iowait
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_ranks(spec: dict, nprocs: int, threads: int, timeout_s: float) -> list[dict]:
    """Launch the worker as ``nprocs`` ranks × ``threads`` threads; → each rank's result, each with
    ``other_cpu_cores``: the cores other processes of the machine kept busy meanwhile, on average."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    res = launch([sys.executable, "-m", "arbor.bench.ep_worker", json.dumps(spec)], nprocs, threads,
                 timeout_s=timeout_s, echo=None)
    tails = "\n".join(f"--- rank {r} ---\n" + "\n".join(lines[-25:]) for r, lines in enumerate(res.output))
    if res.returncode:
        why = "timed out" if res.returncode == 124 else f"failed (exit codes {res.codes})"
        raise RuntimeError(f"bench ep: {spec['phase']} on {nprocs} rank(s) x {threads} thread(s) {why}\n{tails}")
    out = []
    for r, lines in enumerate(res.output):
        found = [line[len(MARK):] for line in lines if line.startswith(MARK)]
        if not found:
            raise RuntimeError(f"bench ep: rank {r} printed no result\n{tails}")
        out.append(json.loads(found[-1]))
    wall, c1 = time.perf_counter() - t0, cpu_seconds()
    others = None if c0 is None or c1 is None else max(0.0, ((c1[0] - c0[0]) - (c1[1] - c0[1])) / wall)
    for r in out:
        r["other_cpu_cores"] = others
    busy = "" if others is None else f"; other processes kept {others:.2f} cores busy"
    print(f"  {spec['phase']}: {nprocs} rank(s) x {threads} thread(s) done in {wall:.1f} s{busy}", flush=True)
    return out


def slowest(ranks: list[dict], key: str) -> list[float]:
    """Per repeat, the slowest rank's seconds."""
    return [max(vals) for vals in zip(*(r["seconds"][key] for r in ranks))]


def comm_share(ranks: list[dict], part: str, total: str) -> list[float]:
    """Per rank, Σ seconds in all_to_all ÷ Σ seconds of the step (or decode)."""
    return [sum(r["seconds"][part]) / max(sum(r["seconds"][total]), 1e-12) for r in ranks]


def summarize_train(ranks: list[dict]) -> dict:
    step = slowest(ranks, "step")
    tokens = ranks[0]["tokens"]
    parts = {k: median([median(r["seconds"][k]) for r in ranks])
             for k in ("forward_backward", "all_to_all", "grad_all_reduce", "optimizer")}
    return {"step_s": step, "median_step_s": median(step), "tokens": tokens, "tokens_per_s": tokens / median(step),
            "all_to_all_share": comm_share(ranks, "all_to_all", "step"), "median_parts_s": parts,
            "first_loss": ranks[0]["first_loss"], "a2a_calls_per_step": ranks[0]["a2a_calls_per_step"],
            "a2a_bytes_per_step": [r["a2a_bytes_per_step"] for r in ranks]}


def summarize_decode(ranks: list[dict]) -> dict:
    decode, gen = slowest(ranks, "decode"), slowest(ranks, "generate")
    r0 = ranks[0]
    return {"decode_s": decode, "generate_s": gen, "decode_tokens": r0["decode_tokens"], "tokens": r0["tokens"],
            "decode_tokens_per_s": r0["decode_tokens"] / median(decode),
            "generate_tokens_per_s": r0["tokens"] / median(gen),
            "all_to_all_share": comm_share(ranks, "decode_all_to_all", "decode"),
            "decode_steps": r0["seconds"]["decode_steps"][0]}


def memory(ranks: list[dict]) -> dict:
    out = {"maxrss_bytes": [r["maxrss_bytes"] for r in ranks],
           "expert_param_bytes": [r["expert_param_bytes"] for r in ranks],
           "other_param_bytes": [r["other_param_bytes"] for r in ranks]}
    if "expert_state_bytes" in ranks[0]:
        out["expert_optimizer_bytes"] = [r["expert_state_bytes"] for r in ranks]
    return out


def run(out_dir="bench_results", device="cpu", ranks=2, shape=None, batch=8, seq_len=256, prompts=16, prompt_len=32,
        new_tokens=64, repeats=5, warmup=1, timeout_s=600.0, seed=0) -> dict:
    shape = shape or model_shape()
    if shape["num_experts"] % ranks or batch % ranks or prompts % ranks:
        raise ValueError(f"--ranks {ranks} must divide the experts ({shape['num_experts']}), --batch ({batch}) "
                         f"and --prompts ({prompts})")
    if new_tokens < 2:
        raise ValueError("--new-tokens must be ≥ 2 (the first token comes from the prefill step)")
    configs = {"single": (1, ranks), "ep": (ranks, 1)}
    labels = {"single": f"1 rank x {ranks} threads", "ep": f"{ranks} ranks x 1 thread (EP {ranks})"}
    base = dict(shape=shape, device=device, batch=batch, seq_len=seq_len, prompts=prompts, prompt_len=prompt_len,
                new_tokens=new_tokens, repeats=repeats, warmup=warmup, seed=seed, timeout_s=min(120.0, timeout_s))
    raw = {}
    for phase in ("train", "decode"):
        for name, (n, threads) in configs.items():
            raw[(phase, name)] = run_ranks({**base, "phase": phase}, n, threads, timeout_s)
    busy = {f"{phase} {k}": raw[(phase, k)][0]["other_cpu_cores"] for phase in ("train", "decode") for k in configs}

    train = {k: summarize_train(raw[("train", k)]) for k in configs}
    decode = {k: summarize_decode(raw[("decode", k)]) for k in configs}
    mem = {k: {"train": memory(raw[("train", k)]), "decode": memory(raw[("decode", k)])} for k in configs}
    total_expert = mem["single"]["train"]["expert_param_bytes"][0]
    share = [b / total_expert for b in mem["ep"]["train"]["expert_param_bytes"]]
    train_ratio = train["ep"]["tokens_per_s"] / train["single"]["tokens_per_s"]
    decode_ratio = decode["ep"]["decode_tokens_per_s"] / decode["single"]["decode_tokens_per_s"]
    gen_ratio = decode["ep"]["generate_tokens_per_s"] / decode["single"]["generate_tokens_per_s"]
    worst = max(share, key=lambda s: abs(s - 1 / ranks))
    ids = {k: raw[("decode", k)][0]["token_ids"] for k in configs}
    same = sum(a == b for a, b in zip(ids["single"], ids["ep"])) / len(ids["single"])
    loss = {k: train[k]["first_loss"] for k in configs}
    targets = [
        {"name": f"train tokens/s, {labels['ep']} / {labels['single']}", "value": train_ratio, "target": ">= 0.8",
         "met": train_ratio >= 0.8},
        {"name": "expert memory per rank / total expert memory (measured, rank farthest from 1/EP)", "value": worst,
         "target": f"1/{ranks} ± 10 %", "met": abs(worst - 1 / ranks) <= 0.1 / ranks and abs(sum(share) - 1) < 1e-9},
    ]
    result = {"config": {**base, "ranks": ranks, "labels": labels},
              "train": train, "decode": decode, "memory": mem,
              "ratios": {"train_tokens_per_s": train_ratio, "decode_tokens_per_s": decode_ratio,
                         "generate_tokens_per_s": gen_ratio},
              "expert_share_per_rank": share, "total_expert_param_bytes": total_expert,
              "checks": {"first_step_loss": loss, "first_step_loss_abs_diff": abs(loss["ep"] - loss["single"]),
                         "decode_same_tokens_fraction": same},
              "other_cpu_cores": busy, "targets": targets}
    for phase in ("train", "decode"):
        for k in configs:
            result["memory"][k][phase]["threads"] = raw[(phase, k)][0]["threads"]

    a2a = lambda s: f"{100 * max(s):.0f} %"
    print_table(f"expert parallelism, {device}: tokens/s (median of {repeats}; a step's time = slowest rank's)",
                ["workload", f"{labels['single']}", labels["ep"], "EP / single", "EP all-to-all share (max rank)"],
                [[f"train {batch}x{seq_len}", train["single"]["tokens_per_s"], train["ep"]["tokens_per_s"], train_ratio,
                  a2a(train["ep"]["all_to_all_share"])],
                 [f"decode {prompts}x{new_tokens}", decode["single"]["decode_tokens_per_s"],
                  decode["ep"]["decode_tokens_per_s"], decode_ratio, a2a(decode["ep"]["all_to_all_share"])],
                 [f"generate (prefill {prompt_len} incl.)", decode["single"]["generate_tokens_per_s"],
                  decode["ep"]["generate_tokens_per_s"], gen_ratio, ""]])
    parts = lambda k: train[k]["median_parts_s"]
    print_table("train step, median seconds per rank (all-to-all is inside forward+backward)",
                ["config", "step", "forward+backward", "  of which all-to-all", "grad all-reduce", "AdamW"],
                [[labels[k], train[k]["median_step_s"], parts(k)["forward_backward"], parts(k)["all_to_all"],
                  parts(k)["grad_all_reduce"], parts(k)["optimizer"]] for k in configs])
    print_table("memory per rank (MiB): peak RSS per workload, expert parameters on the live model",
                ["config", "peak RSS train", "peak RSS decode", "expert params", "expert AdamW state", "expert share"],
                [[labels[k], "/".join(f"{b / MIB:.0f}" for b in mem[k]["train"]["maxrss_bytes"]),
                  "/".join(f"{b / MIB:.0f}" for b in mem[k]["decode"]["maxrss_bytes"]),
                  "/".join(f"{b / MIB:.1f}" for b in mem[k]["train"]["expert_param_bytes"]),
                  "/".join(f"{b / MIB:.1f}" for b in mem[k]["train"]["expert_optimizer_bytes"]),
                  "/".join(f"{b / total_expert:.3f}" for b in mem[k]["train"]["expert_param_bytes"])] for k in configs])
    print_table("targets", ["target", "value", "wanted", "met"],
                [[t["name"], t["value"], t["target"], "yes" if t["met"] else "NO"] for t in targets])
    if any(v is not None and v > 0.1 for v in busy.values()):
        print("note: other processes kept CPU cores busy during the run (" +
              ", ".join(f"{k} {v:.2f}" for k, v in busy.items() if v is not None) +
              " cores): these times are unreliable (the threads of one rank suffer most)")
    print(f"checks: first-step loss {loss['single']:.6f} (single) vs {loss['ep']:.6f} (EP); "
          f"identical greedy completions {100 * same:.0f} %")

    def plot(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        x = [0, 1]
        for i, k in enumerate(configs):
            a.bar([j + (i - 0.5) * 0.4 for j in x],
                  [train[k]["tokens_per_s"], decode[k]["decode_tokens_per_s"]], 0.4, label=labels[k])
            b.bar([j + (i - 0.5) * 0.4 for j in x],
                  [mem[k]["train"]["maxrss_bytes"][0] / MIB, mem[k]["train"]["expert_param_bytes"][0] / MIB], 0.4,
                  label=labels[k])
        a.set_xticks(x, ["train", "decode"])
        a.set_ylabel("tokens/s (median)")
        a.set_title(f"EP/single: train {train_ratio:.2f}, decode {decode_ratio:.2f}")
        b.set_xticks(x, ["peak RSS (train)", "expert params"])
        b.set_ylabel("MiB per rank (rank 0)")
        a.legend(fontsize=7)
        return fig

    write_result(out_dir, "ep", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (1 thread each) vs 1 rank with this many threads")
    add_moe_shape_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="training sequences per step (all ranks together)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompts", type=int, default=16, help="decode prompts (all ranks together)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to each launch of the ranks")


def main(args) -> None:
    shape = model_shape(args.hidden, args.experts, args.top_k, args.moe_intermediate, args.layers, args.vocab)
    run(out_dir=args.out, device=args.device, ranks=args.ranks, shape=shape, batch=args.batch, seq_len=args.seq_len,
        prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
        warmup=args.warmup, timeout_s=args.timeout)
