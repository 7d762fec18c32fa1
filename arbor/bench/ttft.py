"""TTFT under a device-memory bottleneck: request-level vs layer-wise KV allocation (``arbor bench ttft``).

The trace: ``--requests`` requests arriving as a Poisson process (``--rate`` per second), prompts of
``--prompt-tokens`` (uniform, default 1k–4k) random tokens, ``--output-tokens`` greedy outputs (EOS
ignored, so every system computes the same tokens — checked). The model: a tiny dense Qwen3 with
random weights (``--layers`` layers). The device tier holds ``--device-requests`` × the KV of the
longest request (all layers): the bottleneck. Three systems replay the same trace in real time:

- ``request-level``: the single-tier engine whose pool is the device tier (a prefill is admitted
  only when blocks for every layer of its whole context are free);
- ``layer-wise``: ``EngineConfig.layer_kv`` with the same device tier and a host tier for all;
- ``layer-wise+slo``: the same with policy ``layerkv`` (SLO-aware admission).

SLOs are multiples of the unloaded latency measured first on the same engine: TTFT SLO =
``--ttft-slo-x`` × the solo TTFT of the longest prompt, TPOT SLO = ``--tpot-slo-x`` × the solo TPOT.
Reported per system: TTFT p50/p99, TPOT p99, throughput (output tokens / makespan), TTFT- and
TPOT-SLO violation rates, mean device-tier occupancy, copy volume and overlap (layer-wise); a PNG of
device-tier occupancy over time. Targets, for each layer-wise system: p99 TTFT ≥ 5× lower than
request-level, throughput cost ≤ 3 %, fewer SLO violations (requests missing either SLO); and the
same greedy tokens everywhere.

The whole comparison (solo latency, SLOs, the three systems) runs ``--repeats`` times in turn, so a
shared machine's drift hits every system alike. ``results`` holds each figure's median over the
rounds and ``spread`` its [min, max]; a target's value is the median of its per-round values
(``target_runs``), and ``missed`` gives each missed target's measured figures; every round's
figures are in ``rounds``. The plot shows the last round.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from arbor.bench.common import median, print_table, print_targets, target, write_result

SYSTEMS = ["request-level", "layer-wise", "layer-wise+slo"]
KEY_FIGURES = ["ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "throughput_tok_s", "slo_violation_rate"]   # with spread


def _span(text: str) -> list[int]:
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a range LO-HI of integers, got '{text}'") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"range '{text}' must satisfy 1 <= LO <= HI")
    return [a, b]


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=0.7, help="Poisson arrivals per second")
    p.add_argument("--prompt-tokens", type=_span, default=[1024, 4096], metavar="LO-HI")
    p.add_argument("--output-tokens", type=_span, default=[256, 512], metavar="LO-HI")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device-requests", type=float, default=1.5,
                   help="device tier = this many times the KV (all layers) of the longest request")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--ttft-slo-x", type=float, default=5.0, help="TTFT SLO as a multiple of the solo TTFT")
    p.add_argument("--tpot-slo-x", type=float, default=10.0, help="TPOT SLO as a multiple of the solo TPOT")
    p.add_argument("--slo-safety", type=float, default=1.2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of the whole comparison, in turn (medians and min-max spread reported)")
    p.add_argument("--seed", type=int, default=0)


def check(a) -> None:
    for name in ("requests", "layers", "hidden", "vocab", "block_size", "max_num_batched_tokens", "threads",
                 "repeats"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("rate", "device_requests", "ttft_slo_x", "tpot_slo_x"):
        if not getattr(a, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if a.device_requests < 1:
        raise ValueError("--device-requests must be >= 1 (the longest request must fit the device tier)")
    if a.slo_safety < 1:
        raise ValueError(f"--slo-safety must be >= 1, got {a.slo_safety}")


def build_model(a):
    from arbor.models import CausalLM, ModelConfig
    torch.manual_seed(a.seed)
    cfg = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=a.hidden // 4, max_position_embeddings=a.prompt_tokens[1] + a.output_tokens[1] + 16)
    return CausalLM(cfg).to(a.device).eval()


def make_trace(a) -> list[dict]:
    rng = np.random.default_rng(a.seed)
    t, trace = 0.0, []
    for _ in range(a.requests):
        t += rng.exponential(1.0 / a.rate)
        n = int(rng.integers(a.prompt_tokens[0], a.prompt_tokens[1] + 1))
        trace.append(dict(arrival=t, prompt=rng.integers(0, a.vocab, n).tolist(),
                          max_tokens=int(rng.integers(a.output_tokens[0], a.output_tokens[1] + 1))))
    return trace


def engine_config(a, system: str, device_blocks: int, host_blocks: int, slo: dict):
    from arbor.engine import EngineConfig
    common = dict(block_size=a.block_size, max_num_batched_tokens=a.max_num_batched_tokens, device=a.device,
                  max_model_len=a.prompt_tokens[1] + a.output_tokens[1] + 1, max_num_seqs=64,
                  enable_prefix_caching=False)
    if system == "request-level":
        return EngineConfig(num_blocks=device_blocks // a.layers, **common)
    extra = dict(policy="layerkv", tpot_slo=slo["tpot"], ttft_slo=slo["ttft"], slo_safety=a.slo_safety) \
        if system == "layer-wise+slo" else {}
    return EngineConfig(layer_kv=True, device_kv_blocks=device_blocks, host_kv_blocks=host_blocks, **common, **extra)


def occupancy(engine) -> int:
    """Device-tier layer-blocks held now (request-level: blocks of running sequences × layers;
    layer-wise: resident blocks + the staging reserve)."""
    if engine.layer_kv is not None:
        d = engine.layer_kv.device
        return d.resident + d.reserve
    return sum(len(s.block_table) for s in engine.scheduler.running) * len(engine.runner.layer_map)


def replay(engine, trace: list[dict]) -> dict:
    """Feed the trace in real time (a request's arrival is its trace time); step until all finish."""
    from arbor.engine import SamplingParams
    t0 = time.perf_counter()
    pending, ids, occ = list(trace), [], []
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            rid = engine.add_request(r["prompt"], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                                 ignore_eos=True))
            for s in engine.requests[rid]:
                s.arrival = t0 + r["arrival"]
            ids.append(rid)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - (time.perf_counter() - t0)))
            continue
        engine.step()
        occ.append((time.perf_counter() - t0, occupancy(engine)))
    seqs = [engine.requests[rid][0] for rid in ids]
    out = dict(tokens=[s.output_ids for s in seqs],
               ttft=[s.first_token_time - s.arrival for s in seqs],
               tpot=[(s.finish_time - s.first_token_time) / max(1, s.num_output_tokens - 1) for s in seqs],
               makespan=max(s.finish_time for s in seqs) - t0, occupancy=occ,
               output_tokens=sum(s.num_output_tokens for s in seqs))
    for rid in ids:
        engine.pop_finished(rid)
    return out


def solo_latency(a, model, device_blocks: int, trace: list[dict]) -> dict:
    """Unloaded TTFT of the longest prompt and TPOT, on the request-level engine (one request)."""
    from arbor.engine import LLMEngine, SamplingParams
    engine = LLMEngine(model, engine_config(a, "request-level", device_blocks, 0, {}))
    longest = max(trace, key=lambda r: len(r["prompt"]))
    engine.generate([longest["prompt"][:64]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    c = engine.generate([longest["prompt"]], SamplingParams(temperature=0, max_tokens=a.output_tokens[1],
                                                            ignore_eos=True))[0]
    return {"ttft": c.ttft, "tpot": (c.latency - c.ttft) / max(1, len(c.token_ids) - 1)}


def summarize(run: dict, slo: dict) -> dict:
    ttft, tpot = np.array(run["ttft"]), np.array(run["tpot"])
    miss_ttft, miss_tpot = ttft > slo["ttft"], tpot > slo["tpot"]
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_p99_s": float(np.percentile(tpot, 99)), "throughput_tok_s": run["output_tokens"] / run["makespan"],
            "makespan_s": run["makespan"], "ttft_slo_violation_rate": float(miss_ttft.mean()),
            "tpot_slo_violation_rate": float(miss_tpot.mean()),
            "slo_violation_rate": float((miss_ttft | miss_tpot).mean())}


def run_round(a, model, trace, device_blocks: int, host_blocks: int) -> dict:
    """One round: solo latency and SLOs, then every system on the trace; → its figures and token lists."""
    from arbor.engine import LLMEngine
    solo = solo_latency(a, model, device_blocks, trace)
    slo = {"ttft": a.ttft_slo_x * solo["ttft"], "tpot": a.tpot_slo_x * solo["tpot"]}
    print(f"  solo: TTFT {solo['ttft']:.3f} s, TPOT {1e3 * solo['tpot']:.1f} ms -> SLOs: TTFT {slo['ttft']:.2f} s, "
          f"TPOT {1e3 * slo['tpot']:.1f} ms", flush=True)
    results, runs = {}, {}
    for system in SYSTEMS:
        engine = LLMEngine(model, engine_config(a, system, device_blocks, host_blocks, slo))
        t0 = time.perf_counter()
        runs[system] = run = replay(engine, trace)
        res = summarize(run, slo)
        res["mean_occupancy"] = float(np.mean([o for _, o in run["occupancy"]])) / device_blocks
        res["preemptions"] = engine.scheduler.num_preemptions
        if engine.layer_kv is not None:
            res.update(engine.layer_kv.stats())
        results[system] = res
        print(f"  {system}: {time.perf_counter() - t0:.0f} s", flush=True)
    return {"solo": solo, "slo": slo, "results": results, "runs": runs}


def target_values(results: dict) -> dict[str, float]:
    """The targets' values in one round (request-level against each layer-wise system)."""
    req, out = results["request-level"], {}
    for system in SYSTEMS[1:]:
        lkv = results[system]
        out[f"p99 TTFT request-level / {system}"] = req["ttft_p99_s"] / lkv["ttft_p99_s"]
        out[f"throughput cost of {system}"] = 1 - lkv["throughput_tok_s"] / req["throughput_tok_s"]
        out[f"SLO violation rate {system} vs request-level"] = lkv["slo_violation_rate"]
    return out


def make_targets(rounds: list[dict], results: dict, same: bool) -> tuple[list[dict], dict, dict]:
    """(targets, each target's per-round values, {missed target: its measured figures}): a target's value
    is the median of its per-round values; the SLO-violation target compares medians."""
    target_runs = {}
    for values in (target_values(r["results"]) for r in rounds):
        for name, v in values.items():
            target_runs.setdefault(name, []).append(v)
    value = {name: median(vs) for name, vs in target_runs.items()}
    solo_ttft = median([r["solo"]["ttft"] for r in rounds])
    req, targets, missed = results["request-level"], [], {}
    for system in SYSTEMS[1:]:
        lkv, names = results[system], [f"p99 TTFT request-level / {system}", f"throughput cost of {system}",
                                       f"SLO violation rate {system} vs request-level"]
        speedup, cost, rate = (value[n] for n in names)
        targets += [target(names[0], speedup, ">= 5", speedup >= 5),
                    target(names[1], cost, "<= 0.03", cost <= 0.03),
                    target(names[2], rate, f"< {req['slo_violation_rate']:.3g}", rate < req["slo_violation_rate"])]
        why = [f"p99 TTFT request-level {req['ttft_p99_s']:.3g} s, {system} {lkv['ttft_p99_s']:.3g} s",
               f"tokens/s request-level {req['throughput_tok_s']:.4g}, {system} {lkv['throughput_tok_s']:.4g}",
               f"SLO violation rate request-level {req['slo_violation_rate']:.3g}, {system} {rate:.3g}"]
        for t, reason in zip(targets[-3:], why):
            if not t["met"]:
                runs = ", ".join(f"{v:.3g}" for v in target_runs[t["name"]])
                missed[t["name"]] = f"{reason} (medians); per round {runs}; solo TTFT {solo_ttft:.3g} s"
    targets.append(target("greedy outputs identical across systems", float(same), "== 1", same))
    if not same:
        missed[targets[-1]["name"]] = "the systems generated different tokens"
    return targets, target_runs, missed


def main(a) -> None:
    check(a)
    torch.set_num_threads(a.threads)
    model = build_model(a)
    trace = make_trace(a)
    bs, L = a.block_size, a.layers
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in trace)
    device_blocks = int(a.device_requests * -(-longest // bs)) * L
    host_blocks = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // bs) for r in trace) + 1
    print(f"bench ttft: {a.requests} requests, Poisson {a.rate}/s, prompts {a.prompt_tokens}, outputs "
          f"{a.output_tokens}; {L} layers; device tier {device_blocks} layer-blocks "
          f"({a.device_requests} x the longest request), host tier {host_blocks} blocks; {a.repeats} round(s)",
          flush=True)
    rounds = []
    for i in range(a.repeats):
        print(f" round {i + 1} of {a.repeats}", flush=True)
        rounds.append(run_round(a, model, trace, device_blocks, host_blocks))
    tokens = rounds[0]["runs"][SYSTEMS[0]]["tokens"]
    same = all(r["runs"][s]["tokens"] == tokens for r in rounds for s in SYSTEMS)
    results = {s: {k: median([r["results"][s][k] for r in rounds]) for k in rounds[0]["results"][s]} for s in SYSTEMS}
    spread = {s: {k: [min(r["results"][s][k] for r in rounds), max(r["results"][s][k] for r in rounds)]
                  for k in KEY_FIGURES} for s in SYSTEMS}
    print_table(f"TTFT under a device-tier bottleneck (median of {a.repeats} rounds; min-max)",
                ["system", "TTFT p50 s", "TTFT p99 s", "TPOT p99 ms", "tok/s", "TTFT-SLO miss", "TPOT-SLO miss",
                 "occupancy"],
                [[s, *(f"{r[k]:.3g} ({spread[s][k][0]:.3g}-{spread[s][k][1]:.3g})" for k in KEY_FIGURES[:2]),
                  1e3 * r["tpot_p99_s"], r["throughput_tok_s"], r["ttft_slo_violation_rate"],
                  r["tpot_slo_violation_rate"], r["mean_occupancy"]] for s, r in results.items()])
    targets, target_runs, missed = make_targets(rounds, results, same)
    print_targets(targets)
    for name, reason in missed.items():
        print(f"  not met: {name}: {reason}")
    args = {k: v for k, v in vars(a).items() if k not in ("func", "bench", "args", "command")}
    last = rounds[-1]
    solo, slo = ({k: median([r[part][k] for r in rounds]) for k in ("ttft", "tpot")} for part in ("solo", "slo"))
    write_result(a.out, "ttft", {"args": args, "solo": solo, "slo": slo, "device_blocks": device_blocks,
                                 "host_blocks": host_blocks, "repeats": a.repeats, "results": results,
                                 "spread": spread, "target_runs": target_runs, "missed": missed,
                                 "rounds": [{k: r[k] for k in ("solo", "slo", "results")} for r in rounds],
                                 "targets": targets},
                 lambda plt: plot(plt, last["runs"], last["results"], device_blocks))
    if not same:
        raise RuntimeError("bench ttft: the systems generated different tokens")


def plot(plt, runs: dict, results: dict, device_blocks: int):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for system, run in runs.items():
        t = [x for x, _ in run["occupancy"]]
        ax.step(t, [o / device_blocks for _, o in run["occupancy"]], where="post", label=system)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("device-tier occupancy")
    ax.set_title("device tier held (layer-wise: resident + staging reserve)")
    ax.legend()
    for system, run in runs.items():
        ttft = np.sort(run["ttft"])
        bx.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post",
                label=f"{system} (p99 {results[system]['ttft_p99_s']:.2f} s)")
    bx.set_xscale("log")
    bx.set_xlabel("TTFT (s)")
    bx.set_ylabel("fraction of requests")
    bx.set_title("TTFT CDF")
    bx.legend()
    return fig
