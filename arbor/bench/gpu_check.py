"""``make gpu-check``: the CUDA paths in one short run (≤ 10 minutes on one H100/H200), no internet.

Checks, each timed and reported ok / FAIL with its figure (a failure does not stop the others):

1. ``engine_greedy``: the engine's greedy tokens (float32, CUDA) equal transformers' ``generate`` on
   the same random Qwen3 model (hidden 256, 4 layers);
2. ``layer_kv``: the same requests through LayerKV (device and host KV tiers, the copy stream) give
   the same tokens as the plain engine;
3. ``server``: ``arbor serve`` on 127.0.0.1 answers a chat completion (a subprocess, its own CUDA context);
4. ``sft_bf16``: SFT steps of a Qwen3-0.6B-shaped model (hidden 1024, 28 layers, vocabulary 151,936,
   random weights), ``train.dtype=bfloat16``, 2048 tokens a step: median step time, and
   ``torch.cuda.max_memory_allocated`` against the memory plan (``arbor.train.memory_plan``);
5. ``rl_bf16``: ``arbor train`` steps (``dtype=bfloat16``, ``engine.dtype=bfloat16``) of the same shape
   with the built-in tokenizer's vocabulary, on the arithmetic task: step time, peak memory against the plan.

Prints one table and writes ``OUT/gpu-check.json`` (with the device's name). ``--device cpu --small``
runs every check at toy sizes on the CPU (what the test suite does, so the script keeps working).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from arbor.bench.common import sync

SHAPE_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
SHAPE_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def _peak_reset(device):
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def stamp(device, stamps: list) -> None:
    """Append the time once the device has finished the work queued so far."""
    sync(device)
    stamps.append(time.perf_counter())


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _plan_gib(inp) -> float:
    from arbor.train.memory_plan import peak_bytes, plan
    return peak_bytes([it for it in plan(inp) if not it[0].startswith("process")]) / 2**30


def _hf_folder(folder: Path, small: bool) -> Path:
    import transformers as tf
    torch.manual_seed(0)
    dims = SHAPE_SMALL if small else dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(vocab_size=1024, max_position_embeddings=512, **dims)).float()
    model.save_pretrained(folder)
    return folder


def check_engine_greedy(args, device, tmp: Path) -> dict:
    import transformers as tf

    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    folder = _hf_folder(tmp / "hf", args.small)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    engine = LLMEngine(str(folder), EngineConfig(device=str(device), dtype="float32", max_model_len=256, progress=False))
    ours = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))]
    hf = tf.AutoModelForCausalLM.from_pretrained(folder).float().to(device).eval()
    theirs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device=device), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        theirs.append(out[0, len(p):].tolist())
    same = sum(a == b for a, b in zip(ours, theirs))
    return {"ok": same == len(prompts), "detail": f"{same}/{len(prompts)} prompts: equal greedy tokens (24 each)",
            "ours": ours, "transformers": theirs}


def check_layer_kv(args, device, tmp: Path) -> dict:
    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    folder = tmp / "hf"
    if not folder.exists():
        _hf_folder(folder, args.small)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (40, 90, 150, 7)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(str(folder), EngineConfig(device=str(device), block_size=16, max_model_len=256, progress=False))
    want = [c.token_ids for c in plain.generate(prompts, params)]
    tiered = LLMEngine(str(folder), EngineConfig(device=str(device), block_size=16, max_model_len=256, layer_kv=True,
                                                 device_kv_blocks=48, progress=False))
    got = [c.token_ids for c in tiered.generate(prompts, params)]
    stats = tiered.layer_kv.stats() if tiered.layer_kv is not None else {}
    return {"ok": got == want, "detail": f"LayerKV tokens {'equal' if got == want else 'DIFFER from'} the plain engine's",
            "layer_kv": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}


def check_server(args, device, tmp: Path) -> dict:
    import httpx

    from arbor.models.tokenizer import builtin_tokenizer
    from arbor.models import CausalLM, ModelConfig, save_model
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id, **SHAPE_SMALL)),
               tmp / "served", tokenizer=tok)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "arbor", "serve", str(tmp / "served"), "--port", str(port),
                             "--device", str(device)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
        while time.perf_counter() - t0 < 120:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "served", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        body = r.json()
        ok = r.status_code == 200 and body["usage"]["completion_tokens"] >= 1
        return {"ok": ok, "detail": f"HTTP {r.status_code}, {body.get('usage', {}).get('completion_tokens')} tokens"}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def check_sft_bf16(args, device, tmp: Path) -> dict:
    from arbor.models import CausalLM, ModelConfig
    from arbor.models.lora import DEFAULT_TARGETS
    from arbor.train.memory_plan import PlanInputs
    from arbor.train.optim import OptimConfig
    from arbor.train.sft import SFTConfig, sft
    from arbor.train.tree_batch import TreeConfig
    vocab, tokens = (256, 256) if args.small else (151936, 2048)
    mcfg = ModelConfig(vocab_size=vocab, **(SHAPE_SMALL if args.small else SHAPE_06B))
    planned = _plan_gib(PlanInputs(model=mcfg, dtype="bfloat16", lora_rank=0, lora_targets=DEFAULT_TARGETS,
                                   tokens=tokens, recompute=False, device=str(device)))
    torch.manual_seed(0)
    model = CausalLM(mcfg).to(device)
    g = torch.Generator().manual_seed(1)
    examples = [(torch.randint(0, vocab, (512,), generator=g).tolist(), [1] * 512) for _ in range(max(1, tokens // 512))]
    stamps = [time.perf_counter()]
    _peak_reset(device)
    rows = sft(model, examples, SFTConfig(steps=args.steps, log_every=1, checkpoint_every=0, batch_tokens=tokens,
                                          dtype="bfloat16", tree=TreeConfig(enabled=False, token_cap=tokens),
                                          optim=OptimConfig(lr=1e-5, warmup_steps=0)),
               on_log=lambda r: stamp(device, stamps))
    steps = [b - a for a, b in zip(stamps, stamps[1:])][1:] or [stamps[-1] - stamps[0]]
    peak = _peak_gib(device)
    finite = all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    return {"ok": finite, "step_s": statistics.median(steps), "peak_gib": peak, "plan_gib": planned,
            "detail": f"median step {statistics.median(steps):.3f} s, peak "
                      f"{'-' if peak is None else f'{peak:.2f}'} GiB vs plan {planned:.2f} GiB"}


def check_rl_bf16(args, device, tmp: Path) -> dict:
    import asyncio

    from arbor import configs
    from arbor.models import CausalLM, ModelConfig, save_model
    from arbor.models.tokenizer import builtin_tokenizer
    from arbor.train.config import RLConfig
    from arbor.train.memory_plan import from_rl
    from arbor.train.run import build_trainer
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                                    **(SHAPE_SMALL if args.small else SHAPE_06B))), tmp / "rl-model", tokenizer=tok)
    cfg = configs.load(RLConfig, None, [f"model={json.dumps(str(tmp / 'rl-model'))}", f"out={json.dumps(str(tmp / 'rl'))}",
                                        f"device={json.dumps(str(device))}", "dtype=\"bfloat16\"",
                                        "engine.dtype=\"bfloat16\"", "task=\"arithmetic\"", "groups_per_step=8",
                                        "checkpoint_every=0", "rollout.max_context=512", "tree.token_cap=4096"])
    planned = _plan_gib(from_rl(cfg))
    trainer = build_trainer(cfg)
    _peak_reset(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        row = asyncio.run(trainer.train_step())
        times.append(time.perf_counter() - t0)
    peak = _peak_gib(device)
    step = statistics.median(times[1:] or times)
    return {"ok": bool(torch.isfinite(torch.tensor(float(row["loss"])))), "step_s": step,
            "peak_gib": peak, "plan_gib": planned, "mismatch_abs": row.get("mismatch_abs"),
            "detail": f"median step {step:.3f} s, peak {'-' if peak is None else f'{peak:.2f}'} GiB vs plan "
                      f"{planned:.2f} GiB, bf16 train/infer mismatch {row.get('mismatch_abs', float('nan')):.2e}"}


CHECKS = {"engine_greedy": check_engine_greedy, "layer_kv": check_layer_kv, "server": check_server,
          "sft_bf16": check_sft_bf16, "rl_bf16": check_rl_bf16}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arbor.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (a CPU run of the same code)")
    p.add_argument("--steps", type=int, default=3, help="SFT and RL steps (the first is not timed)")
    p.add_argument("--only", help="comma-separated checks to run (default all): " + ", ".join(CHECKS))
    p.add_argument("--out", default="runs/gpu-check")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or `--device cpu --small` to exercise the script", file=sys.stderr)
        return 2
    names = [n.strip() for n in (args.only or ",".join(CHECKS)).split(",") if n.strip()]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        print(f"gpu-check: unknown checks {unknown}; choose from {list(CHECKS)}", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.perf_counter()
            try:
                res = CHECKS[name](args, device, Path(tmp))
            except Exception as e:         # one broken path must not hide the others' results
                res = {"ok": False, "detail": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            res["seconds"] = time.perf_counter() - t0
            results[name] = res
            print(f"{name:14s} {'ok  ' if res['ok'] else 'FAIL'} {res['seconds']:7.1f} s  {res['detail']}", flush=True)
    from arbor.bench.common import machine, run_info
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "machine": machine(), "run": run_info(), "args": vars(args), "results": results}
    (out / "gpu-check.json").write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out / 'gpu-check.json'}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
