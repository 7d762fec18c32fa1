"""Rollout throughput, Arbor's engine vs transformers ``generate`` (``arbor bench engine``).

Tiny-Qwen3 shape with random weights, greedy, EOS ignored. Workloads:
- ``batch16``: 16 prompts × 64 tokens → 128 new tokens each; transformers batched (DynamicCache,
  float32, left padding) vs Arbor float32 and bfloat16; medians over interleaved repeats.
- ``mixed256``: 256 requests, prompt and output lengths uniform in [16, 128]; transformers runs
  static batches of ``hf_batch`` (left-padded, each batch to its longest output; only requested
  tokens count), Arbor gets all requests at once (continuous batching).
- ``multiturn``: conversations re-send their growing history each turn; Arbor with and without
  prefix caching, and the prefix-cache hit rate (prompt tokens served from cache / prompt tokens),
  for the Qwen3 model and for a hybrid one (the tree bench's Gated DeltaNet 3:1 + MoE config,
  whose prefix hits restore recurrent-state snapshots).
Throughput = generated (requested) tokens / wall seconds; ratio = Arbor ÷ transformers.
"""

from __future__ import annotations

import random

import torch

from arbor.bench.common import median, print_table, print_targets, target, time_interleaved, write_result
from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.models import CausalLM, ModelConfig
from arbor.models.checkpoint import from_hf_tensors

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


def build_pair(device):
    import transformers as tf
    torch.manual_seed(0)
    hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**SHAPE)).float().to(device).eval()
    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"architectures": ["Qwen3ForCausalLM"]})
    with torch.device("meta"):
        arbor = CausalLM(cfg)
    arbor.load_state_dict(from_hf_tensors(dict(hf.state_dict()), arbor), assign=True)
    return hf, arbor.to(device).eval()


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
    return LLMEngine(model, EngineConfig(dtype=dtype, device=device, num_blocks=num_blocks, max_model_len=512, **kw))


def fresh_generate(eng, prompts, params):
    eng.block_manager.reset_prefix_cache()   # repeats must not hit the previous repeat's cache
    return eng.generate(prompts, params)


def random_prompts(rng, n, lo, hi):
    return [[rng.randrange(SHAPE["vocab_size"]) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


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


def run(out_dir="bench_results", device="cpu", repeats=3, batch=16, prompt_len=64, new_tokens=128, mixed=256,
        hf_batch=64, convs=16, turns=4, threads=None, check=True):
    if threads:
        torch.set_num_threads(threads)
    hf, model = build_pair(device)
    rng = random.Random(0)
    result = {"config": {**SHAPE, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "mixed": mixed,
                         "hf_batch": hf_batch, "convs": convs, "turns": turns, "repeats": repeats,
                         "threads": torch.get_num_threads()}, "workloads": {}}
    rows = []

    # ---- 16 × 64 → 128 ------------------------------------------------------------------
    prompts = random_prompts(rng, batch, prompt_len, prompt_len)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    blocks = batch * -(-(prompt_len + new_tokens) // 16) + 8
    e32, e16 = engine(model, "float32", device, blocks), engine(model, "bfloat16", device, blocks)
    if check:
        ours = [o.token_ids for o in e32.generate(prompts, greedy)]
        result["batch16_tokens_equal_transformers"] = ours == hf_generate(hf, prompts, new_tokens, device)
    fns = {"transformers": lambda: hf_generate(hf, prompts, new_tokens, device),
           "arbor-fp32": lambda: fresh_generate(e32, prompts, greedy),
           "arbor-bf16": lambda: fresh_generate(e16, prompts, greedy)}
    times = time_interleaved(fns, repeats, device=device)
    toks = batch * new_tokens
    tps = {k: toks / median(v) for k, v in times.items()}
    result["workloads"]["batch16"] = {"seconds": times, "tokens_per_s": tps}
    for k in ("arbor-fp32", "arbor-bf16"):
        rows.append([f"{batch}x{prompt_len}->{new_tokens}", k, tps["transformers"], tps[k], tps[k] / tps["transformers"]])

    # ---- 256 mixed ----------------------------------------------------------------------
    reqs = [(p, rng.randint(16, 128)) for p in random_prompts(rng, mixed, 16, 128)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    e = engine(model, "float32", device, num_blocks=4096, max_num_seqs=256, max_num_batched_tokens=2048)

    def hf_mixed():
        for i in range(0, len(reqs), hf_batch):
            part = reqs[i:i + hf_batch]
            hf_generate(hf, [p for p, _ in part], max(m for _, m in part), device)

    times = time_interleaved({"transformers": hf_mixed, "arbor-fp32": lambda: fresh_generate(e, [p for p, _ in reqs], params)},
                             1, warmup=0, device=device)
    toks = sum(m for _, m in reqs)
    tps = {k: toks / median(v) for k, v in times.items()}
    result["workloads"]["mixed256"] = {"seconds": times, "tokens_per_s": tps, "tokens": toks}
    rows.append([f"{mixed} mixed", "arbor-fp32", tps["transformers"], tps["arbor-fp32"], tps["arbor-fp32"] / tps["transformers"]])

    # ---- multi-turn ---------------------------------------------------------------------
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
    result["workloads"]["multiturn"] = mt
    print_table(f"engine throughput (generated tokens/s), greedy, {device}, threads {torch.get_num_threads()}",
                ["workload", "arbor", "transformers tok/s", "arbor tok/s", "arbor/transformers"], rows)
    ratio = lambda w, k: result["workloads"][w]["tokens_per_s"][k] / result["workloads"][w]["tokens_per_s"]["transformers"]
    best16 = max(ratio("batch16", k) for k in ("arbor-fp32", "arbor-bf16"))
    result["targets"] = [
        target(f"{batch} requests: Arbor tokens/s / transformers (fp32)", ratio("batch16", "arbor-fp32"), ">= 2",
               ratio("batch16", "arbor-fp32") >= 2),
        target(f"{batch} requests: Arbor tokens/s / transformers (bf16)", ratio("batch16", "arbor-bf16"), ">= 2",
               ratio("batch16", "arbor-bf16") >= 2),
        target(f"{mixed} mixed requests: ratio above the {batch}-request one", ratio("mixed256", "arbor-fp32"),
               f"> {best16:.3g}", ratio("mixed256", "arbor-fp32") > best16)]
    print_targets(result["targets"])
    print_table(f"multi-turn: {convs} conversations x {turns} turns (history re-sent)",
                ["arbor", "seconds", "prefix-cache hit rate"],
                [[k, v["seconds"], v["hit_rate"]] for k, v in mt.items()])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [f"{r[0]}\n{r[1]}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[2] for r in rows], 0.4, label="transformers")
        ax.bar([i + 0.2 for i in x], [r[3] for r in rows], 0.4, label="arbor")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("generated tokens/s")
        ax.legend()
        return fig

    write_result(out_dir, "engine", result, plot)
    return result


def add_arguments(p) -> None:
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mixed", type=int, default=256)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")


def main(args) -> None:
    run(out_dir=args.out, device=args.device, repeats=args.repeats, batch=args.batch, new_tokens=args.new_tokens,
        mixed=args.mixed, threads=args.threads)
