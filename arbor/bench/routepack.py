"""RoutePack vs token balancing and Karmarkar–Karp + static experts: planner and 2-rank EP training (``arbor bench routepack``).

Traces (every sample's replayed expert ids per MoE layer and token):
- ``synthetic``: Zipf-skewed expert popularity varying by layer, topic-tilted per sample, long-tailed
  (Pareto) lengths (``arbor.plan.traces``);
- ``recorded``: rollouts of the bench's MoE model (random weights from fixed seeds): the engine
  samples completions of random prompts (long-tailed prompt and completion lengths), then one
  forward per sequence records every token's top-k experts (what routing replay would force); the
  measured steps take the first ``--step-samples`` rollouts of the first windows.

(a) Planner only, per window of ``--samples`` samples: the modeled step time (``arbor.plan.cost``,
read from ``--cost-file`` or else fitted here as ``arbor plan calibrate --ep`` does) of RoutePack,
token balancing and KK + static contiguous experts, and each one's ratio to the step's lower bound
(``step_lower_bound``); the rate of windows whose row count is certified; planner seconds.

(b) Measured: 2 ranks × 1 thread, EP 2 with DP attention on the same ranks (``routepack_worker``),
training steps on both trace kinds; per window of ``--window-steps`` steps RoutePack places experts
once (``plan_window``: from the window's demand, refined on the EP peaks of the window's laid-out
slots; an expert leaves its rank of the previous window only while the max load is more than
``--move-tolerance`` above the balanced one's, or where the modeled gain beats the migration's
modeled cost: ``--move-s`` seconds per moved expert + ``--move-layer-s`` per MoE layer changed, both
measured on 2 ranks by ``arbor plan calibrate`` and read from the cost file, or measured here when it
has none) and packs and lays out every step. Its migrations (weights + AdamW moments) are timed apart: from
one window's placement to the next (what a run pays) and, as an upper bound, from the static one;
"incl. migration" adds the window-to-window time (the static one when there is one window) once per
window. A step's time is the slowest rank's; tokens/s = Σ tokens ÷ Σ median step time; methods run
interleaved.

Targets: measured tokens/s RoutePack ÷ KK + static ≥ 1.10 on the synthetic skewed traces; ≥ 95 %
of planned windows certified; planner time per window ≤ 10 % of a measured training step.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from arbor.bench.common import add_moe_shape_arguments, median, print_table, write_result
from arbor.bench.ep import cpu_seconds, model_shape
from arbor.bench.plan_cost import bench_cost_model
from arbor.plan import AnnealConfig, CostModel, Sample, kk_workload, plan_window, routepack, token_balance
from arbor.plan.routepack import moved, step_lower_bound
from arbor.plan.traces import synthetic

METHODS = ["token balance", "KK + static", "RoutePack"]


def record_traces(shape: dict, windows: int, samples: int, seed: int, max_len: int) -> list[list[np.ndarray]]:
    """Rollouts of the bench model (one process) → per window, each sample's expert ids [Lm, n, k]."""
    import torch

    from arbor.models.random_init import random_moe_model
    from arbor.distributed import DistContext
    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    from arbor.models import VarlenAttention
    from arbor.plan.traces import lengths
    model = random_moe_model(shape, DistContext.single(), torch.device("cpu")).eval()
    rng = np.random.default_rng(seed)
    n = windows * samples
    gen_len = lengths(n, rng, 4, 64, 1.5)
    prompt_len = np.maximum(4, np.minimum(lengths(n, rng, 24, max_len, 1.3), max_len - gen_len))
    prompts = [rng.integers(0, shape["vocab_size"], int(p)).tolist() for p in prompt_len]
    engine = LLMEngine(model, EngineConfig(max_model_len=max_len + 16, max_num_seqs=64, seed=seed,
                                           num_blocks=64 * (max_len // 16 + 2)))
    params = [SamplingParams(temperature=1.0, max_tokens=int(g), ignore_eos=True, seed=seed + i)
              for i, g in enumerate(gen_len)]
    seqs = [p + c.token_ids for p, c in zip(prompts, engine.generate(prompts, params))]
    out = []
    with torch.no_grad():
        for s in seqs:
            routed = model(torch.tensor(s), VarlenAttention.from_lengths([len(s)]), return_routing=True).routed_experts
            out.append(routed.numpy().astype(np.int64))
    return [out[w * samples:(w + 1) * samples] for w in range(windows)]


def synthetic_windows(shape: dict, windows: int, samples: int, seed: int, max_len: int) -> list[list[np.ndarray]]:
    """Windows of one run: the base popularity is shared, each window draws its own samples."""
    moe_layers, E, k = shape["num_hidden_layers"], shape["num_experts"], shape["num_experts_per_tok"]
    first, pop = synthetic(samples, E, moe_layers, k, seed=seed, max_len=max_len)
    return [first] + [synthetic(samples, E, moe_layers, k, seed=seed + w, max_len=max_len, popularity=pop)[0]
                      for w in range(1, windows)]


def plan_all(window: list[np.ndarray], E: int, cap: int, cost: CostModel, anneal: AnnealConfig, placements=None):
    samples = [Sample.from_ids(x, E) for x in window]
    out, secs = {}, {}
    for name, fn in (("token balance", lambda: token_balance(samples, 2, 2, cap, cost)),
                     ("KK + static", lambda: kk_workload(samples, 2, 2, cap, cost)),
                     ("RoutePack", lambda: routepack(samples, 2, 2, cap, cost, anneal_cfg=anneal,
                                                     placements=placements))):
        t0 = time.perf_counter()
        out[name] = fn()
        secs[name] = time.perf_counter() - t0
    return out, secs


def planner_only(kind: str, windows, E: int, cap: int, cost: CostModel, anneal: AnnealConfig) -> dict:
    rows = []
    for w in windows:
        plans, secs = plan_all(w, E, cap, cost, anneal)
        rp = plans["RoutePack"]
        rows.append({"energy": {m: plans[m].energy for m in METHODS}, "planner_s": secs,
                     "bound_s": step_lower_bound([Sample.from_ids(x, E) for x in w], 2, 2, cap, cost),
                     "certified": rp.packing.certified, "gap": rp.packing.gap, "rows": len(rp.packing.rows),
                     "bound": rp.packing.bound, "slots": {m: plans[m].slots for m in METHODS},
                     "tokens": int(sum(x.shape[1] for x in w)), "ep_peak_static":
                         float(np.mean([p.max_over_mean for p in plans["KK + static"].placements])),
                     "ep_peak_routepack": float(np.mean([p.max_over_mean for p in rp.placements])),
                     "ep_peak_over_bound": float(np.mean([p.max_over_bound for p in rp.placements]))})
    med = {m: median([r["energy"][m] for r in rows]) for m in METHODS}
    return {"kind": kind, "windows": rows, "median_energy_s": med,
            "kk_over_routepack": median([r["energy"]["KK + static"] / r["energy"]["RoutePack"] for r in rows]),
            "token_over_routepack": median([r["energy"]["token balance"] / r["energy"]["RoutePack"] for r in rows]),
            "over_bound": {m: sum(r["energy"][m] for r in rows) / sum(r["bound_s"] for r in rows) for m in METHODS},
            "certified_rate": float(np.mean([r["certified"] for r in rows])),
            "planner_s": {m: median([r["planner_s"][m] for r in rows]) for m in METHODS},
            "planner_s_max": max(r["planner_s"]["RoutePack"] for r in rows)}


def measured_plans(steps: list[list[np.ndarray]], window_steps: int, E: int, cap: int, cost: CostModel,
                   anneal: AnnealConfig, tolerance: float = 0.0, move_s: float = 0.0,
                   move_layer_s: float = 0.0) -> tuple[dict, list[dict]]:
    """Plans for every step; RoutePack's placement is fixed per window of ``window_steps`` steps
    (``plan_window``: from the window's routing, refined on its layouts, experts moved from the
    previous window's placement only where the modeled gain pays ``move_s`` per expert and
    ``move_layer_s`` per MoE layer changed)."""
    plans, info, current = {m: [] for m in METHODS}, [], None
    for start in range(0, len(steps), window_steps):
        window = [[Sample.from_ids(x, E) for x in step] for step in steps[start:start + window_steps]]
        t0 = time.perf_counter()
        rp = plan_window(window, 2, 2, cap, cost, current, anneal, tolerance, move_s, move_layer_s)
        window_s = time.perf_counter() - t0
        moves = moved(rp[0].placements, current)
        current = [p.rank_of for p in rp[0].placements]
        for samples, p in zip(window, rp):
            base = {"token balance": token_balance(samples, 2, 2, cap, cost), "KK + static": kk_workload(samples, 2, 2, cap, cost),
                    "RoutePack": p}
            for m in METHODS:
                plans[m].append(base[m])
            info.append({"energy": {m: base[m].energy for m in METHODS}, "planner_s": window_s,
                         "bound_s": step_lower_bound(samples, 2, 2, cap, cost),
                         "certified": p.packing.certified, "window": start // window_steps, "moved": moves})
    return plans, info
def run_measured(kind: str, steps, shape: dict, plans: dict, repeats: int, warmup: int, timeout_s: float,
                 window_steps: int) -> dict:
    from arbor.distributed.launch import launch
    from arbor.bench.routepack_worker import MARK
    from arbor.plan.traces import save_traces
    samples = [x for step in steps for x in step]
    step_ids, k = [], 0
    for step in steps:
        step_ids.append(list(range(k, k + len(step))))
        k += len(step)
    with tempfile.TemporaryDirectory() as tmp:
        save_traces(Path(tmp) / "traces.npz", samples)
        spec = {"shape": shape, "traces": str(Path(tmp) / "traces.npz"), "methods": METHODS, "repeats": repeats,
                "warmup": warmup, "timeout_s": min(300.0, timeout_s),
                "steps": [{"samples": ids} for ids in step_ids],
                "plans": {m: [{"cells": [[[step_ids[t][i] for i in cell] for cell in rank] for rank in p.cells],
                               "placements": [{"rank_of": q.rank_of, "slot_of": q.slot_of} for q in p.placements]}
                              for t, p in enumerate(plans[m])] for m in METHODS},
                "window_starts": list(range(0, len(steps), window_steps))}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        t0, c0 = time.perf_counter(), cpu_seconds()
        res = launch([sys.executable, "-m", "arbor.bench.routepack_worker", str(Path(tmp) / "spec.json")], 2, 1,
                     timeout_s=timeout_s, echo=None)
        wall, c1 = time.perf_counter() - t0, cpu_seconds()
    tails = "\n".join(f"--- rank {r} ---\n" + "\n".join(lines[-25:]) for r, lines in enumerate(res.output))
    if res.returncode:
        raise RuntimeError(f"bench routepack: measured {kind} failed (exit codes {res.codes})\n{tails}")
    ranks = []
    for lines in res.output:
        found = [line[len(MARK):] for line in lines if line.startswith(MARK)]
        if not found:
            raise RuntimeError(f"bench routepack: a rank printed no result\n{tails}")
        ranks.append(json.loads(found[-1]))
    others = None if c0 is None or c1 is None else max(0.0, ((c1[0] - c0[0]) - (c1[1] - c0[1])) / wall)
    print(f"  measured {kind}: 2 ranks x 1 thread done in {wall:.0f} s"
          + ("" if others is None else f"; other processes kept {others:.2f} cores busy"), flush=True)
    tokens = [sum(x.shape[1] for x in step) for step in steps]
    step_s = {m: [median([max(v) for v in zip(*(r["seconds"][m][t] for r in ranks))]) for t in range(len(steps))]
              for m in METHODS}
    tps = {m: sum(tokens) / sum(step_s[m]) for m in METHODS}
    migr = [g for g in ranks[0]["migrations"] if g["to"] == "RoutePack"]
    between = ranks[0]["window_migrations"]
    static_s = median([g["seconds"] for g in migr]) if migr else 0.0
    mig_s = median([g["seconds"] for g in between]) if between else static_s
    return {"kind": kind, "tokens_per_step": tokens, "step_s": step_s, "tokens_per_s": tps,
            "rank_seconds": [r["seconds"] for r in ranks],
            "routepack_over_kk": tps["RoutePack"] / tps["KK + static"],
            "routepack_over_token": tps["RoutePack"] / tps["token balance"],
            "migration_s": mig_s, "migration_from_static_s": static_s, "window_migrations": between,
            "migration_moved": median([g["moved"] for g in (between or migr)]) if (between or migr) else 0,
            "migration_bytes_per_rank": median([g["bytes_sent"] for g in (between or migr)]) if (between or migr) else 0,
            "other_cpu_cores": others, "wall_s": wall}


def run(out_dir="bench_results", device="cpu", shape=None, windows=20, samples=64, cap=2048, max_len=2048,
        recorded_windows=4, measure_steps=4, window_steps=2, step_samples=32, repeats=5, warmup=1, seed=0,
        cost_file=None, anneal=None, timeout_s=1800.0, measure=True, move_s=None, move_layer_s=None,
        move_tolerance=0.02) -> dict:
    shape = shape or model_shape()
    E = shape["num_experts"]
    anneal = anneal or AnnealConfig()
    if step_samples > samples:
        raise ValueError(f"--step-samples ({step_samples}) must be ≤ --samples ({samples}): measured recorded steps "
                         "take the first samples of the recorded windows")
    need = measure and (move_s is None or move_layer_s is None)
    cost, _ = bench_cost_model(shape, cap, out_dir, cost_file, timeout_s, need_migration=need)
    move_s = cost.move_s if move_s is None else move_s
    move_layer_s = cost.move_layer_s if move_layer_s is None else move_layer_s
    print(f"cost model: a={cost.a:.3g} s/token, b={cost.b:.3g} s/token², c1={cost.c1:.3g} s/sequence, "
          f"e={cost.e:.3g} s/routed row, c0={cost.c0:.3g} s ({cost.meta.get('file', cost.meta.get('source', 'fitted now'))})", flush=True)
    if measure:
        print(f"migration priced at {move_s:.3g} s per moved expert + {move_layer_s:.3g} s per MoE layer changed"
              + (" (measured)" if "migration" in cost.meta else ""), flush=True)
    traces = {"synthetic": synthetic_windows(shape, windows, samples, seed, max_len)}
    recorded = []
    if recorded_windows or measure:
        t0 = time.perf_counter()
        count = max(recorded_windows, measure_steps if measure else 0)
        recorded = record_traces(shape, count, samples, seed, max_len)
        print(f"recorded {count * samples} rollouts in {time.perf_counter() - t0:.0f} s", flush=True)
    if recorded_windows:
        traces["recorded"] = recorded[:recorded_windows]
    planner = {k: planner_only(k, w, E, cap, cost, anneal) for k, w in traces.items() if w}
    measured, measured_info = {}, {}
    if measure:
        for kind in ("synthetic", "recorded"):
            if kind == "synthetic":
                _, pop = synthetic(1, E, shape["num_hidden_layers"], shape["num_experts_per_tok"], seed=seed + 500,
                                   max_len=max_len)
                steps = [synthetic(step_samples, E, shape["num_hidden_layers"], shape["num_experts_per_tok"],
                                   seed=seed + 600 + t, max_len=max_len, popularity=pop)[0] for t in range(measure_steps)]
            else:         # the first samples of the recorded windows
                steps = [window[:step_samples] for window in recorded[:measure_steps]]
            plans, info = measured_plans(steps, window_steps, E, cap, cost, anneal, move_tolerance, move_s,
                                         move_layer_s)
            measured_info[kind] = info
            measured[kind] = run_measured(kind, steps, shape, plans, repeats, warmup, timeout_s, window_steps)
            measured[kind]["modeled_step_s"] = {m: [i["energy"][m] for i in info] for m in METHODS}
            measured[kind]["modeled_bound_s"] = [i["bound_s"] for i in info]
            measured[kind]["planner_s"] = [i["planner_s"] for i in info]
            measured[kind]["certified"] = [i["certified"] for i in info]
            measured[kind]["planned_moves"] = [i["moved"] for i in info[::window_steps]]
    return report(out_dir, shape, cost, planner, measured, dict(
        windows=windows, samples=samples, cap=cap, max_len=max_len, recorded_windows=recorded_windows,
        measure_steps=measure_steps, window_steps=window_steps, step_samples=step_samples, repeats=repeats,
        warmup=warmup, seed=seed, anneal=anneal.__dict__, device=device, move_s=move_s, move_layer_s=move_layer_s,
        move_tolerance=move_tolerance))


def report(out_dir, shape, cost, planner, measured, config) -> dict:
    certified = [w["certified"] for p in planner.values() for w in p["windows"]]
    certified += [c for m in measured.values() for c in m["certified"]]
    rate = float(np.mean(certified)) if certified else 0.0
    plan_s = [w["planner_s"]["RoutePack"] for p in planner.values() for w in p["windows"]]
    plan_s += [s for m in measured.values() for s in m["planner_s"]]
    rp_step = [median(m["step_s"]["RoutePack"]) for m in measured.values()]
    plan_ratio = max(plan_s) / min(rp_step) if rp_step else None
    syn = measured.get("synthetic")
    targets = [
        {"name": "measured tokens/s, RoutePack / KK + static (synthetic skewed traces, 2 EP ranks)",
         "value": syn["routepack_over_kk"] if syn else None, "target": ">= 1.10",
         "met": bool(syn and syn["routepack_over_kk"] >= 1.10)},
        {"name": "windows with a certified row count", "value": rate, "target": ">= 0.95", "met": rate >= 0.95},
        {"name": "planner seconds per window (max) / measured RoutePack step seconds (median)", "value": plan_ratio,
         "target": "<= 0.10", "met": plan_ratio is not None and plan_ratio <= 0.10},
    ]
    for kind, p in planner.items():
        print_table(f"(a) planner only, {kind} traces: {len(p['windows'])} windows of {config['samples']} samples, "
                    f"token cap {config['cap']}, DP 2 x EP 2; modeled step seconds (median)",
                    ["method", "modeled step s", "÷ RoutePack", "Σ ÷ Σ lower bound", "planner ms (median)"],
                    [[m, p["median_energy_s"][m], median([w["energy"][m] / w["energy"]["RoutePack"] for w in p["windows"]]),
                      p["over_bound"][m], 1e3 * p["planner_s"][m]] for m in METHODS])
        print(f"  certified windows {100 * p['certified_rate']:.0f} %; EP peak max/mean static "
              f"{median([w['ep_peak_static'] for w in p['windows']]):.3f} -> RoutePack "
              f"{median([w['ep_peak_routepack'] for w in p['windows']]):.3f} "
              f"(÷ lower bound {median([w['ep_peak_over_bound'] for w in p['windows']]):.3f})")
    for kind, m in measured.items():
        rows = [[name, m["tokens_per_s"][name], m["tokens_per_s"][name] / m["tokens_per_s"]["KK + static"],
                 sum(m["modeled_step_s"]["KK + static"]) / sum(m["modeled_step_s"][name]),
                 sum(m["modeled_step_s"][name]) / sum(m["modeled_bound_s"]), sum(m["step_s"][name])] for name in METHODS]
        windows = -(-len(m["step_s"]["RoutePack"]) // config["window_steps"])
        amort = sum(m["step_s"]["RoutePack"]) + m["migration_s"] * windows
        rows.append(["RoutePack incl. migration", sum(m["tokens_per_step"]) / amort,
                     sum(m["tokens_per_step"]) / amort / m["tokens_per_s"]["KK + static"], "", "", amort])
        m["routepack_incl_migration_over_kk"] = rows[-1][2]
        print_table(f"(b) measured, {kind} traces: {len(m['tokens_per_step'])} steps of {config['step_samples']} samples "
                    f"({sum(m['tokens_per_step'])} tokens), 2 ranks x 1 thread, EP 2, median of {config['repeats']}",
                    ["method", "tokens/s", "÷ KK + static", "modeled ÷ KK", "modeled ÷ lower bound", "Σ step s"], rows)
        print(f"  RoutePack migration: {m['migration_s']:.3f} s from one window's placement to the next (median "
              f"{m['migration_moved']} experts moved, {m['migration_bytes_per_rank'] / 2**20:.0f} MiB sent per rank), "
              f"once per {config['window_steps']} steps; {m['migration_from_static_s']:.3f} s from the static placement; "
              f"experts moved into each window as planned: {m['planned_moves']}")
    print_table("targets", ["target", "value", "wanted", "met"],
                [[t["name"], t["value"], t["target"], "yes" if t["met"] else "NO"] for t in targets])
    busy = {k: m["other_cpu_cores"] for k, m in measured.items()}
    if any(v is not None and v > 0.1 for v in busy.values()):
        print("note: other processes kept CPU cores busy during the measured runs ("
              + ", ".join(f"{k} {v:.2f}" for k, v in busy.items() if v is not None) + " cores): times are unreliable")
    result = {"config": {**config, "shape": shape}, "cost_model": {"a": cost.a, "b": cost.b, "e": cost.e,
                                                                  "c0": cost.c0, "c1": cost.c1, "move_s": cost.move_s,
                                                                  "move_layer_s": cost.move_layer_s, "meta": cost.meta},
              "planner": planner, "measured": measured, "certified_rate": rate, "other_cpu_cores": busy,
              "targets": targets}

    def plot(plt):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        x = np.arange(len(METHODS))
        for i, (kind, p) in enumerate(planner.items()):
            axes[0].bar(x + (i - 0.5) * 0.4, [p["median_energy_s"][m] for m in METHODS], 0.4, label=kind)
        axes[0].set_xticks(x, METHODS, fontsize=8)
        axes[0].set_ylabel("modeled step s (median window)")
        axes[0].set_title("(a) planner only")
        axes[0].legend(fontsize=7)
        for i, (kind, m) in enumerate(measured.items()):
            axes[1].bar(x + (i - 0.5) * 0.4, [m["tokens_per_s"][n] for n in METHODS], 0.4, label=kind)
        axes[1].set_xticks(x, METHODS, fontsize=8)
        axes[1].set_ylabel("tokens/s (2 EP ranks)")
        axes[1].set_title("(b) measured training steps")
        if measured:
            axes[1].legend(fontsize=7)
        return fig

    write_result(out_dir, "routepack", result, plot)
    return result


def add_arguments(p) -> None:
    add_moe_shape_arguments(p)
    p.add_argument("--windows", type=int, default=20, help="synthetic windows planned in (a)")
    p.add_argument("--samples", type=int, default=64, help="samples per planned window in (a)")
    p.add_argument("--recorded-windows", type=int, default=4, help="recorded-rollout windows planned in (a)")
    p.add_argument("--token-cap", type=int, default=2048, help="tokens per row (micro-batch)")
    p.add_argument("--max-len", type=int, default=2048, help="longest sample")
    p.add_argument("--measure-steps", type=int, default=4, help="training steps per trace kind in (b)")
    p.add_argument("--window-steps", type=int, default=2, help="steps sharing one RoutePack placement in (b)")
    p.add_argument("--step-samples", type=int, default=32, help="samples per training step in (b)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--population", type=int, default=16)
    p.add_argument("--levels", type=int, default=8)
    p.add_argument("--sweeps", type=int, default=24)
    p.add_argument("--move-s", type=float, default=None,
                   help="RoutePack's modeled seconds per migrated expert (weights + AdamW moments): a placement "
                        "change must gain more than this per expert it moves (default: the cost file's, measured "
                        "by arbor plan calibrate; measured now when it has none)")
    p.add_argument("--move-layer-s", type=float, default=None,
                   help="modeled seconds per MoE layer whose placement changes, on top of --move-s "
                        "(default: the cost file's, as --move-s)")
    p.add_argument("--move-tolerance", type=float, default=0.02,
                   help="keep experts where they are while the window's max EP load stays within this of the balanced one's")
    p.add_argument("--cost-file", help="cost model JSON (arbor plan calibrate); default: calibrate now")
    p.add_argument("--no-measure", action="store_true", help="planner only (skip (b))")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed to each launch of the ranks")


def main(args) -> None:
    for name in ("windows", "samples", "recorded_windows", "token_cap", "max_len", "measure_steps", "window_steps",
                 "step_samples", "repeats", "population", "levels", "sweeps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    for name in ("warmup", "move_s", "move_layer_s", "move_tolerance"):
        value = getattr(args, name)
        if value is not None and not (value >= 0 and np.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number ≥ 0, got {value}")
    shape = model_shape(args.hidden, args.experts, args.top_k, args.moe_intermediate, args.layers, args.vocab)
    run(out_dir=args.out, device=args.device, shape=shape, windows=args.windows, samples=args.samples,
        cap=args.token_cap, max_len=args.max_len, recorded_windows=args.recorded_windows,
        measure_steps=args.measure_steps, window_steps=args.window_steps, step_samples=args.step_samples,
        repeats=args.repeats, warmup=args.warmup, cost_file=args.cost_file, timeout_s=args.timeout,
        anneal=AnnealConfig(population=args.population, levels=args.levels, sweeps=args.sweeps),
        measure=not args.no_measure, move_s=args.move_s, move_layer_s=args.move_layer_s,
        move_tolerance=args.move_tolerance)
