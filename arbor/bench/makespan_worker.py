"""One rank of ``arbor bench makespan`` (started by ``arbor.distributed.launch``; not run by hand).

``python -m arbor.bench.makespan_worker '<json spec>'``: builds the model of the spec (the same
weights on every rank from one seed; experts split over the ranks when ``WORLD_SIZE`` > 1), draws the
agentic workload (``workload``; rank r of W drives trajectories r, r + W, …) and runs it to the end
under each policy, ``repeats`` rounds with the policies interleaved, each on a fresh engine over the
same weights. Prints one line ``MAKESPAN_RESULT <json>``.

The driver (``drive``) is the agent loop of an RL rollout: a trajectory's turn is a request; when it
finishes, its tool call starts and answers after the trajectory's drawn latency with an observation
whose tokens are appended to the history; the next turn is a request on the whole history (a
continuation prefill that hits the prefix cache). Under expert parallelism every loop iteration
starts with one flag all-reduce (engine work anywhere? tool calls pending anywhere?), so the ranks
step in lockstep and sleep together while every trajectory waits on a tool.
"""

from __future__ import annotations

import os

import torch

if __name__ == "__main__":     # first, before any torch work (a rank gets OMP_NUM_THREADS from the launcher)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

import heapq  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

MARK = "MAKESPAN_RESULT "


def workload(spec: dict) -> list[dict]:
    """The trajectories (from ``spec['seed']``): prompt ids, and per turn the output length, the tool
    output's ids and the tool latency (log-normal: median ``tool_median_s``, σ ``tool_sigma``)."""
    rng = random.Random(spec["seed"])
    vocab = spec["model"]["vocab_size"]
    trajs = []
    for _ in range(spec["trajectories"]):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*spec["prompt_tokens"]))]
        turns = [dict(out=rng.randint(*spec["output_tokens"]),
                      tool=[rng.randrange(vocab) for _ in range(rng.randint(*spec["tool_tokens"]))],
                      latency=spec["tool_median_s"] * rng.lognormvariate(0.0, spec["tool_sigma"]))
                 for _ in range(spec["turns"])]
        trajs.append(dict(prompt=prompt, turns=turns))
    return trajs


def drive(engine, trajs: list[dict], ctx) -> dict:
    """Run ``trajs`` to the end on ``engine``; → makespan, per-request TTFTs, outputs, stalls."""
    from arbor.engine import SamplingParams
    t0 = time.perf_counter()
    history = [list(t["prompt"]) for t in trajs]
    turn = [0] * len(trajs)
    outputs = [[] for _ in trajs]
    ttft_first, ttft_cont = [], []
    live: dict[str, int] = {}
    tools: list[tuple[float, int]] = []          # (time the tool answers, trajectory)

    def submit(i):
        params = SamplingParams(temperature=0.0, max_tokens=trajs[i]["turns"][turn[i]]["out"], ignore_eos=True)
        live[engine.add_request(history[i], params)] = i

    for i in range(len(trajs)):
        submit(i)
    while True:
        now = time.perf_counter()
        while tools and tools[0][0] <= now:
            _, i = heapq.heappop(tools)
            history[i] += trajs[i]["turns"][turn[i] - 1]["tool"]
            submit(i)
        work, waiting = float(engine.has_unfinished()), float(bool(tools))
        if ctx is not None and ctx.distributed:
            work, waiting = ctx.flags_max(work, waiting, name="makespan loop")
        if work:
            for seq in engine.step():
                if not seq.is_finished:
                    continue
                i = live.pop(seq.request_id)
                c = engine.pop_finished(seq.request_id)[0]
                (ttft_cont if turn[i] else ttft_first).append(c.ttft)
                outputs[i].append(c.token_ids)
                history[i] += c.token_ids
                turn[i] += 1
                if turn[i] < len(trajs[i]["turns"]):
                    heapq.heappush(tools, (time.perf_counter() + trajs[i]["turns"][turn[i] - 1]["latency"], i))
        elif waiting:
            wake = tools[0][0] if tools else now + 0.002
            time.sleep(max(0.0, min(wake - time.perf_counter(), 0.002)))
        else:
            break
    makespan = time.perf_counter() - t0
    return {"makespan_s": makespan, "ttft_first_s": ttft_first, "ttft_continuation_s": ttft_cont,
            "decode_stall_s": engine.decode_stall_s,
            "decode_tokens": sum(len(o) - 1 for out in outputs for o in out),
            "generated_tokens": sum(len(o) for out in outputs for o in out),
            "outputs_crc": zlib.crc32(json.dumps(outputs).encode()),
            "boundary_decode_steps": engine.stats().get("boundary_decode_steps", 0),
            "timeline": [(p, a - t0, b - t0, n) for p, a, b, n in engine.timeline]}


def main(spec: dict) -> None:
    from arbor.distributed import DistConfig, init_distributed
    from arbor.engine import EngineConfig, LLMEngine
    from arbor.models import CausalLM, ModelConfig
    from arbor.models.expert_parallel import shard_experts
    mc = ModelConfig(**spec["model"])
    ctx = init_distributed(DistConfig(timeout_s=spec["timeout_s"], phase_groups=True), mc.num_experts)
    torch.manual_seed(0)
    model = CausalLM(mc).eval()
    shard_experts(model, ctx)
    trajs = workload(spec)[ctx.rank::ctx.world_size]
    warm = [dict(prompt=t["prompt"][:64], turns=[dict(t["turns"][0], out=4, latency=0.0)]) for t in trajs[:2]]
    results = {p: [] for p in spec["policies"]}
    for r in range(spec["repeats"] + 1):           # round 0: warm-up on a short workload, not kept
        for policy in spec["policies"]:
            engine = LLMEngine(model, EngineConfig(policy=policy, max_model_len=spec["max_model_len"],
                                                   max_num_batched_tokens=spec["max_num_batched_tokens"],
                                                   pd_segment_layers=spec["pd_segment_layers"],
                                                   pd_threads=spec["pd_threads"]), ctx=ctx)
            engine.timeline = []
            if ctx.distributed:
                ctx.barrier("makespan start")
            out = drive(engine, warm if r == 0 else trajs, ctx)
            engine.close()
            if r:
                results[policy].append(out)
    print(MARK + json.dumps({"rank": ctx.rank, "results": results}), flush=True)
    from arbor.distributed.context import leave
    leave(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
