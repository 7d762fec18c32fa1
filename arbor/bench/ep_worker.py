"""One rank of ``arbor bench ep`` (started by ``arbor.distributed.launch``; not run by hand).

``python -m arbor.bench.ep_worker '<json spec>'``: the spec names the phase (``train`` or ``decode``),
the model shape and the workload. Every rank builds the same model (parameters initialised from a
seed per parameter name, and per logical expert, so a rank holding experts 8…15 has exactly the
weights the whole model has there) on the meta device, keeps only its own experts when ``WORLD_SIZE``
> 1 (``shard_experts``), then materialises what it holds: no rank ever allocates the whole model.
The global workload is drawn from fixed seeds on every rank; rank r of W takes the r-th W-th of it.

Timing: every timed repeat starts at a barrier (none on one rank); each rank reports its own
seconds. Time inside ``torch.distributed.all_to_all_single`` (the EP counts and rows exchanges,
forward and backward) is measured by wrapping that function in this process only.
Prints one line ``EP_RESULT <json>`` per rank.
"""

from __future__ import annotations

import os

import torch

if __name__ == "__main__":     # first, before any torch work (a rank gets OMP_NUM_THREADS from the launcher)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from arbor.bench.common import sync  # noqa: E402
from arbor.bench.ep import MARK  # noqa: E402
from arbor.distributed import DistConfig, init_distributed, shutdown  # noqa: E402
from arbor.models import VarlenAttention  # noqa: E402
from arbor.models.expert_parallel import is_expert_param  # noqa: E402
from arbor.models.random_init import random_moe_model  # noqa: E402
from arbor.train.distributed import reduce_gradients  # noqa: E402
from arbor.train.adamw import AdamW  # noqa: E402


class CommTimer:
    """Wraps ``dist.all_to_all_single`` (what ``arbor.distributed.all_to_all`` calls) to sum its seconds."""

    def __init__(self):
        self.seconds, self.calls, self.bytes = 0.0, 0, 0
        self._inner = dist.all_to_all_single
        dist.all_to_all_single = self._timed

    def _timed(self, output, input, *args, **kw):
        t0 = time.perf_counter()
        try:
            return self._inner(output, input, *args, **kw)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            self.bytes += input.numel() * input.element_size()

    def reset(self):
        self.seconds, self.calls, self.bytes = 0.0, 0, 0


def param_bytes(model, expert: bool) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_expert_param(n) == expert)


def state_bytes(opt, model, expert: bool) -> int:
    """Optimizer-state bytes of the expert (or non-expert) parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    return sum(v.numel() * v.element_size() for p, st in opt.state.items() if is_expert_param(names[id(p)]) == expert
               for v in st.values() if torch.is_tensor(v) and v.dim() > 0)


def share(seqs: list, ctx) -> list:
    per = len(seqs) // ctx.world_size
    return seqs[ctx.rank * per:(ctx.rank + 1) * per]


def barrier(ctx, device):
    sync(device)
    if ctx.distributed:
        ctx.barrier("repeat start")


def now(device) -> float:
    sync(device)
    return time.perf_counter()


def run_train(spec: dict, ctx, model, timer: CommTimer, device) -> dict:
    B, S, vocab = spec["batch"], spec["seq_len"], spec["shape"]["vocab_size"]
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(spec["seed"]))
    mine = torch.stack(share(list(ids), ctx))
    n = mine.shape[0]
    labels = torch.cat([mine[:, 1:], torch.full((n, 1), -100)], 1).reshape(-1)
    labels, tokens, attn = labels.to(device), mine.reshape(-1).to(device), VarlenAttention.from_lengths([S] * n, device)
    global_labels = B * (S - 1)
    model.train()
    opt = AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)   # as make_optimizer (arbor train)
    parts = {"forward_backward": [], "grad_all_reduce": [], "optimizer": [], "step": [], "all_to_all": []}
    losses = []
    for r in range(spec["warmup"] + spec["repeats"]):
        barrier(ctx, device)
        timer.reset()
        t0 = now(device)
        opt.zero_grad(set_to_none=True)
        logits = model.logits(model(tokens, attn).hidden)
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / global_labels
        loss.backward()
        t1 = now(device)
        reduce_gradients(model, ctx)
        t2 = now(device)
        opt.step()
        t3 = now(device)
        losses.append(loss.item())
        if r >= spec["warmup"]:
            for k, v in (("forward_backward", t1 - t0), ("grad_all_reduce", t2 - t1), ("optimizer", t3 - t2),
                         ("step", t3 - t0), ("all_to_all", timer.seconds)):
                parts[k].append(v)
    a2a_calls, a2a_bytes = timer.calls, timer.bytes
    global_losses = ctx.sum_floats(losses, "losses") if ctx.distributed else losses
    return {"seconds": parts, "first_loss": global_losses[0], "losses": global_losses, "tokens": B * S,
            "rank_tokens": n * S, "a2a_calls_per_step": a2a_calls, "a2a_bytes_per_step": a2a_bytes,
            "expert_state_bytes": state_bytes(opt, model, True), "other_state_bytes": state_bytes(opt, model, False)}


def run_decode(spec: dict, ctx, model, timer: CommTimer, device) -> dict:
    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    N, P, M, vocab = spec["prompts"], spec["prompt_len"], spec["new_tokens"], spec["shape"]["vocab_size"]
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    prompts = share(torch.randint(0, vocab, (N, P), generator=gen).tolist(), ctx)
    model.eval()
    blocks = len(prompts) * -(-(P + M) // 16) + 8
    cfg = EngineConfig(dtype="float32", device=str(device), num_blocks=blocks, max_model_len=P + M + 16,
                       max_num_seqs=max(1, len(prompts)))
    eng = LLMEngine(model, cfg, ctx=ctx if ctx.distributed else None)
    greedy = SamplingParams(temperature=0, max_tokens=M, ignore_eos=True)
    parts = {"generate": [], "prefill": [], "decode": [], "decode_all_to_all": [], "decode_steps": []}
    outputs = None
    for r in range(spec["warmup"] + spec["repeats"]):
        eng.block_manager.reset_prefix_cache()
        barrier(ctx, device)
        ids = [eng.add_request(p, greedy) for p in prompts]
        t0 = now(device)
        eng.step()                       # prefill of this rank's prompts (and their first tokens)
        t1 = now(device)
        timer.reset()
        steps = 0
        while eng.any_rank_unfinished():
            eng.step()
            steps += 1
        t2 = now(device)
        outs = [c for rid in ids for c in eng.pop_finished(rid)]
        if r >= spec["warmup"]:
            for k, v in (("generate", t2 - t0), ("prefill", t1 - t0), ("decode", t2 - t1),
                         ("decode_all_to_all", timer.seconds), ("decode_steps", steps)):
                parts[k].append(v)
        outputs = [o.token_ids for o in outs]
    if any(len(o) != M for o in outputs):
        raise RuntimeError(f"expected {M} tokens per prompt, got {sorted({len(o) for o in outputs})}")
    every = [o for part in ctx.all_gather_object(outputs, "outputs") for o in part] if ctx.distributed else outputs
    return {"seconds": parts, "tokens": N * M, "decode_tokens": N * (M - 1), "token_ids": every}


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    shape, device = spec["shape"], spec.get("device", "cpu")
    ctx = init_distributed(DistConfig(ep_size=0, timeout_s=spec.get("timeout_s", 120)), shape["num_experts"], device)
    device = ctx.device if ctx.distributed else torch.device(device)
    timer = CommTimer()
    model = random_moe_model(shape, ctx, device)
    out = {"rank": ctx.rank, "world_size": ctx.world_size, "ep_size": ctx.ep_size, "threads": torch.get_num_threads(),
           "expert_param_bytes": param_bytes(model, True), "other_param_bytes": param_bytes(model, False)}
    run = run_train if spec["phase"] == "train" else run_decode
    out.update(run(spec, ctx, model, timer, device))
    out["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.type == "cuda":
        out["max_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    if ctx.distributed:
        ctx.barrier("done")
    print(MARK + json.dumps(out), flush=True)
    shutdown(ctx)

if __name__ == "__main__":
    main(sys.argv[1:])
