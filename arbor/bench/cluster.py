"""Scale-out on Ray: RL step time and rollout tokens/s with 1 vs 2 engine replicas, weight-sync time per method.

On a local Ray cluster (this machine's cores, no dashboard, session files under ``--work``), a random
Qwen3 (by default ``arbor bench engine``'s tiny shape: hidden 256, 4 layers, 4/2 heads of 64,
intermediate 768; 3.2 M parameters) runs the same synchronous RL steps (longtail task, ``--groups`` 64 ×
4 samples, each at most ``--max-new`` tokens, 1 trainer rank, colocated, every actor one thread) in these
systems:
- ``local``: the single-process loop (``RLTrainer`` with its own in-process engine, one thread), the baseline;
- ``ray, E replica(s)``: ``arbor train cluster=ray`` with E engine replicas, object-store sync;
- ``ray, 2 replicas, broadcast``: the same with the gloo broadcast sync.
Every system samples the same tokens (seeds per sample, float32 engines), so the work is identical;
figures are medians over ``--steps`` steps after one warm-up step. Rollout tokens/s = the step's
generated tokens ÷ its rollout phase; step time = the wall time of the whole step. Each replica's
engine steps are metered (``replica.StepMeter``): CPU ÷ wall below 1 means it waited for a core.

Why this shape by default: a synchronous rollout takes as many engine steps as its longest sample
whatever the replicas, so a second replica shortens it only as much as halving the batch shortens a
step. A rollout of real size is bound by the batch's work (a step's cost grows with its batch); the
0.8 M-parameter toy (``--hidden 128 --head-dim 32``, the ``tiny`` preset) at 8 groups is bound by
per-step overhead instead, which a second replica cannot split.

Weight sync per method, at a size where it matters: a manager with 2 replicas of a larger random model
(``--sync-hidden`` × ``--sync-layers``; 25 M parameters, 97 MiB float32 by default) and a publisher in
this process time ``update_weights`` (``--sync-repeats`` each, interleaved) for both methods; the
faster one should be ``ClusterConfig.weight_sync``'s default.

Targets: rollout tokens/s with 2 replicas ≥ 1.5 × 1 replica; the default sync method is the faster
(its time ≤ the other's) at the large size.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

from arbor.bench.common import median, print_table, print_targets, target, write_result

MB = 1 << 20


def model_config(tok, hidden: int, layers: int, intermediate: int = 0, heads: int = 0, kv_heads: int = 0,
                 head_dim: int = 64):
    """The rollout model's shape: the ``tiny`` preset's Qwen3 (tied embeddings, the tokenizer's vocab) with
    these sizes; 0 picks the default (intermediate 3 × hidden, hidden ÷ head_dim heads, heads ÷ 2 KV heads)."""
    from arbor.models import ModelConfig
    from arbor.models.presets import PRESETS
    intermediate = intermediate or 3 * hidden
    heads = heads or hidden // head_dim
    kv_heads = kv_heads or max(1, heads // 2)
    bad = [f"{name} must be > 0 (got {v})" for name, v in (("--hidden", hidden), ("--layers", layers),
                                                           ("--intermediate", intermediate), ("--heads", heads),
                                                           ("--kv-heads", kv_heads), ("--head-dim", head_dim)) if v <= 0]
    if not bad and heads % kv_heads:
        bad.append(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if bad:
        raise ValueError("; ".join(bad))
    shape = dict(PRESETS["tiny"], hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    return ModelConfig(**shape, vocab_size=-(-tok.vocab_size // 64) * 64, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def longest_prompt(tok) -> int:
    """Tokens of the longtail task's longest prompt (a 3-digit length; 1- and 2-digit ones are 1–2 shorter)."""
    from arbor.rollout.chat import prompt_ids
    from arbor.tasks.longtail import LongTailEnvironment, LongTailProblem
    return len(prompt_ids(tok, asyncio.run(LongTailEnvironment(LongTailProblem("a", 256)).reset())))


def rl_words(model: Path, out: Path, steps: int, max_new: int, groups: int, prompt: int) -> list[str]:
    """The RL run's keys. A longtail sample asks for its own length (``max_turn_tokens`` is the task's),
    so ``max_new`` caps it through the context: ``prompt`` (the longest prompt) + ``max_new`` tokens."""
    return [f"model={model}", f"out={out}", "task=longtail", f"steps={steps}", f"groups_per_step={groups}", "checkpoint_every=0",
            "c3po.enabled=false", f"rollout.max_turn_tokens={max_new}", f"rollout.max_context={prompt + max_new}",
            "rollout.branch=[4]", "log.progress=false", "log.tensorboard=false"]


def summarise(rows: list[dict]) -> dict:
    rows = rows[1:]                                 # the first step warms caches up
    return {"step_s": median([r["seconds"] for r in rows]), "rollout_s": median([r["rollout_s"] for r in rows]),
            "sync_s": median([r["sync_s"] for r in rows]), "train_s": median([r["train_s"] for r in rows]),
            "tokens_per_s": median([r["finished_tokens"] / r["rollout_s"] for r in rows]),
            "tokens": median([r["finished_tokens"] for r in rows]), "history": rows}


def local_run(words: list[str]) -> dict:
    """The single-process loop on one thread (as each Ray actor here)."""
    import torch

    from arbor import configs
    from arbor.train.config import RLConfig
    from arbor.train.run import build_trainer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = build_trainer(configs.load(RLConfig, None, words))
        return summarise(asyncio.run(trainer.run()))
    finally:
        torch.set_num_threads(threads)


def ray_run(words: list[str], engines: int, sync: str, stream_interval_ms: float = 50.0) -> dict:
    from arbor.cluster.config import load_train_config
    from arbor.cluster.run import ClusterRun
    cfg = load_train_config(None, ["cluster=ray", f"cluster.engines={engines}", "cluster.trainers=1",
                                   f"cluster.weight_sync={sync}", f"cluster.stream_interval_ms={stream_interval_ms}", *words])
    run = ClusterRun(cfg)
    try:
        t0 = time.perf_counter()
        run.start()
        started = time.perf_counter() - t0
        out = summarise(run.wait())
    finally:
        run.close()
    steps = [{k: r[k] for k in ("steps", "step_s", "step_cpu_s")} for r in run.info.get("replicas_at_end", [])]
    return {**out, "start_s": started, "replica_steps": steps}


def sync_times(model_dir: Path, repeats: int) -> dict:
    """Seconds per ``update_weights`` of a publisher here to 2 replicas, per method (interleaved)."""
    import ray
    import torch

    from arbor.cluster.manager import Bundle, ReplicaManager
    from arbor.cluster.remote_engine import RemoteEngine
    from arbor.cluster.replica import ReplicaSpec
    from arbor.models import load_model
    pg = ray.util.placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    spec = ReplicaSpec(str(model_dir), dict(dtype="float32", max_model_len=64, max_num_seqs=4), 1)
    manager = ray.remote(ReplicaManager).options(num_cpus=0).remote(spec, [Bundle(pg, 0, 0.5, 0)] * 2)
    try:
        ray.get(manager.start.remote())
        state = load_model(model_dir).state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        clients = {m: RemoteEngine(manager, weight_sync=m, timeout_s=60) for m in ("store", "broadcast")}
        times = {m: [] for m in clients}
        for i in range(repeats + 1):
            for m, client in clients.items():
                client.version = ray.get(manager.stats.remote())["version"]
                with torch.no_grad():
                    state = {k: v + 1e-3 for k, v in state.items()}
                dt = client.update_weights(state)
                if i:                                   # the first builds the broadcast group
                    times[m].append(dt)
        return {"bytes": nbytes, **{m: median(ts) for m, ts in times.items()}, "all": times}
    finally:
        for _, h in ray.get(manager.table.remote()):
            ray.kill(h)
        ray.kill(manager)
        ray.util.remove_placement_group(pg)


def run(out_dir="bench_results", steps=4, max_new=48, groups=64, sync_hidden=512, sync_layers=8, sync_repeats=5, work=None,
        stream_interval_ms=50.0, hidden=256, layers=4, intermediate=0, heads=0, kv_heads=0, head_dim=64):
    import torch

    from arbor.cluster import ray_env
    from arbor.cluster.config import ClusterConfig
    from arbor.models import CausalLM, ModelConfig, save_model
    from arbor.models.tokenizer import builtin_tokenizer
    tok = builtin_tokenizer()
    shape = model_config(tok, hidden, layers, intermediate, heads, kv_heads, head_dim)     # checked before any work
    load_before = os.getloadavg()[0]
    if load_before > 0.5 * (os.cpu_count() or 1):
        print(f"warning: the machine is busy (1-min load average {load_before:.1f} on {os.cpu_count()} cores): "
              "the replicas compete with other processes, so the 2-replica figures understate scaling")
    work = Path(work or tempfile.mkdtemp(prefix="bench_cluster_"))
    torch.manual_seed(0)
    model = CausalLM(shape).eval()
    params = sum(p.numel() for p in model.parameters())
    save_model(model, work / "rollout", tokenizer=tok)
    del model
    torch.manual_seed(0)
    big = CausalLM(ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=shape.vocab_size,
                               hidden_size=sync_hidden, intermediate_size=3 * sync_hidden, num_hidden_layers=sync_layers,
                               num_attention_heads=sync_hidden // 64, num_key_value_heads=sync_hidden // 128,
                               head_dim=64, eos_token_id=tok.eos_token_id))
    save_model(big, work / "big", tokenizer=tok)
    del big
    prompt = longest_prompt(tok)
    words = lambda name: rl_words(work / "rollout", work / name, steps + 1, max_new, groups, prompt)
    systems = {"local (one process)": local_run(words("local"))}
    started = ray_env.start(ClusterConfig(temp_dir=str(work / "ray")), work)
    try:
        for engines, sync in ((1, "store"), (2, "store"), (2, "broadcast")):
            name = f"ray, {engines} replica{'s' if engines > 1 else ''}" + (", broadcast" if sync == "broadcast" else "")
            systems[name] = ray_run(words(name.replace(" ", "_").replace(",", "")), engines, sync, stream_interval_ms)
        sync = sync_times(work / "big", sync_repeats)
    finally:
        ray_env.stop(started)
    share = lambda s: " ".join(f"{r['step_cpu_s'] / r['step_s']:.2f}" for r in s.get("replica_steps", []) if r["step_s"]) or "-"
    rows = [[n, 1e3 * s["step_s"], 1e3 * s["rollout_s"], s["tokens_per_s"], 1e3 * s["train_s"], 1e3 * s["sync_s"], share(s)]
            for n, s in systems.items()]
    model_name = (f"Qwen3 hidden {shape.hidden_size}, {shape.num_hidden_layers} layers, {params / 1e6:.1f} M parameters")
    print_table(f"one synchronous RL step ({groups}x4 samples, <= {max_new} tokens), {model_name}, median of {steps}",
                ["system", "step ms", "rollout ms", "rollout tok/s", "train ms", "sync ms", "replica CPU/wall"], rows)
    print_table(f"weight sync to 2 replicas, {sync['bytes'] / MB:.0f} MB float32, median of {sync_repeats}",
                ["method", "ms"], [["store (object store)", 1e3 * sync["store"]], ["broadcast (gloo)", 1e3 * sync["broadcast"]]])
    one, two = systems["ray, 1 replica"], systems["ray, 2 replicas"]
    default = ClusterConfig().weight_sync
    other = "broadcast" if default == "store" else "store"
    result = {"config": {"steps": steps, "max_new": max_new, "groups": groups, "samples": 4, "sync_bytes": sync["bytes"],
                         "stream_interval_ms": stream_interval_ms,
                         "model": {"hidden": shape.hidden_size, "layers": shape.num_hidden_layers,
                                   "intermediate": shape.intermediate_size, "heads": shape.num_attention_heads,
                                   "kv_heads": shape.num_key_value_heads, "head_dim": shape.head_dim, "parameters": params}},
              "systems": systems, "sync": sync, "default_sync": default,
              "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
              "rollout_speedup_2_vs_1": two["tokens_per_s"] / one["tokens_per_s"],
              "step_time_2_vs_1": two["step_s"] / one["step_s"]}
    result["targets"] = [
        target("rollout tokens/s, 2 replicas ÷ 1", result["rollout_speedup_2_vs_1"], ">= 1.5",
               result["rollout_speedup_2_vs_1"] >= 1.5),
        target(f"default sync ({default}) time ÷ {other}, {sync['bytes'] / MB:.0f} MB", sync[default] / sync[other], "<= 1",
               sync[default] <= sync[other])]
    print_targets(result["targets"])

    def plot(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
        names = list(systems)
        a.barh(names, [systems[n]["tokens_per_s"] for n in names])
        a.set_xlabel("rollout tokens/s (median)")
        b.bar(["store", "broadcast"], [1e3 * sync["store"], 1e3 * sync["broadcast"]])
        b.set_ylabel(f"ms per sync, {sync['bytes'] / MB:.0f} MB to 2 replicas")
        return fig

    write_result(out_dir, "cluster", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=4, help="measured RL steps per system (after one warm-up)")
    p.add_argument("--max-new", type=int, default=48,
                   help="most new tokens per sample (the context is the longest prompt + this)")
    p.add_argument("--groups", type=int, default=64, help="groups (of 4 samples) per RL step")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the rollout model (128 with --head-dim 32: the toy)")
    p.add_argument("--layers", type=int, default=4, help="layers of the rollout model")
    p.add_argument("--intermediate", type=int, default=0, help="MLP size of the rollout model (0: 3 x hidden)")
    p.add_argument("--heads", type=int, default=0, help="attention heads of the rollout model (0: hidden / head-dim)")
    p.add_argument("--kv-heads", type=int, default=0, help="KV heads of the rollout model (0: heads / 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head size of the rollout model")
    p.add_argument("--sync-hidden", type=int, default=512, help="hidden size of the weight-sync model")
    p.add_argument("--sync-layers", type=int, default=8)
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--work", help="folder for the models, runs and Ray's files (default: a new temp folder)")
    p.add_argument("--stream-interval-ms", type=float, default=50.0,
                   help="cluster.stream_interval_ms of the Ray runs (least time between two answers to a client's poll)")


def main(args) -> None:
    if args.device != "cpu":
        raise ValueError("arbor bench cluster runs on CPU (its replicas are Ray actors with CPU bundles)")
    run(out_dir=args.out, steps=args.steps, max_new=args.max_new, groups=args.groups, sync_hidden=args.sync_hidden,
        sync_layers=args.sync_layers, sync_repeats=args.sync_repeats, work=args.work,
        stream_interval_ms=args.stream_interval_ms, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate,
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
