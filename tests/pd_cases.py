"""Rank programs for tests/test_pd_multiplex.py: prefill (P) and decode (D) executors of one EP model
on 2 ranks, with and without phase-private groups, an in-order device queue and the turnstile; and
the engine's concurrent P/D workers, with the turnstile and without (naive).
Run only as child processes (``arbor.distributed.launch``); each case exits non-zero on failure."""

import copy
import os
import random
import sys
import threading

import torch

from arbor.distributed import CollectiveError, DistConfig, TagMismatchError, init_distributed
from arbor.engine.policies.device_queue import DeviceQueue
from arbor.engine.policies.turnstile import Turnstile
from arbor.models import CausalLM, VarlenAttention
from arbor.models.expert_parallel import ep_phase, idle_forward, shard_experts
from tests.dist_cases import sequences, tiny_config


def setup(phase_groups: bool, queue: bool, dtype=torch.float32):
    ctx = init_distributed(DistConfig(timeout_s=float(os.environ.get("CASE_TIMEOUT", "20")), phase_groups=phase_groups), 4)
    torch.manual_seed(0)
    ref = CausalLM(tiny_config(True)).to(dtype).eval()
    model = copy.deepcopy(ref)
    shard_experts(model, ctx)
    if queue:
        ctx.queue = DeviceQueue(f"rank{ctx.rank}")
    return ctx, model, ref


def packed(seqs):
    return torch.tensor([t for s in seqs for t in s]), VarlenAttention.from_lengths([len(s) for s in seqs])


def fail(message: str, code: int = 3):
    print(message, flush=True)
    sys.stdout.flush()
    os._exit(code)


@torch.inference_mode()
def case_naive():
    """One shared group, no turnstile, skewed ranks: rank 0's P exchange meets rank 1's D exchange."""
    ctx, model, _ = setup(phase_groups=False, queue=False)
    ids, attn = packed(sequences(11 + ctx.rank, 2))
    first = "prefill" if ctx.rank == 0 else "decode"
    try:
        with ep_phase(model, first):
            model(ids, attn)
    except TagMismatchError as e:
        fail(f"TagMismatchError: {e}")
    fail("the crossed P/D exchange went unnoticed", 1)


@torch.inference_mode()
def case_private_no_turnstile():
    """Private P and D groups through the in-order queue, no turnstile, forced skew (events): rank 0
    queues P's exchange before D's, rank 1 D's before P's → each queue's head waits for a peer job
    stuck behind the other head: a deadlock, caught by the group timeout."""
    ctx, model, _ = setup(phase_groups=True, queue=True)
    submitted = {"prefill": threading.Event(), "decode": threading.Event()}
    inner = ctx.queue.submit

    def submit(fn):                     # note which phase reached the queue first
        future = inner(fn)
        submitted[model.ep_state.phase].set()
        return future
    ctx.queue.submit = submit
    leader = "prefill" if ctx.rank == 0 else "decode"
    errors = []

    @torch.inference_mode()
    def executor(phase):
        if phase != leader:
            submitted[leader].wait()
        try:
            with ep_phase(model, phase):
                model(*packed(sequences(20 + ctx.rank, 2)))
        except (CollectiveError, RuntimeError) as e:
            errors.append(e)
    threads = [threading.Thread(target=executor, args=(p,)) for p in ("prefill", "decode")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        fail(f"deadlock caught: {errors[0]}")
    fail("no deadlock without the turnstile", 1)


@torch.inference_mode()
def case_turnstile(rounds: str = "20"):
    """P segments and D steps on two threads per rank with random skew; the turnstile orders them:
    no error, no hang, and every output equals the one-process model's (greedy tokens too), both in
    float64 so that only the order of the expert sums differs."""
    ctx, model, ref = setup(phase_groups=True, queue=True, dtype=torch.float64)
    rng = random.Random(100 + ctx.rank)
    requests, done = [], []
    decode_ready = threading.Event()

    def decode_step():                  # the D executor's step: this rank's decodes, or an empty one
        batch = requests.pop() if requests else None
        with ep_phase(model, "decode"):
            if batch is None:
                idle_forward(model)
            else:
                done.append(("decode", batch, model(*packed(batch)).hidden))

    @torch.inference_mode()
    def d_executor():
        while True:
            decode_ready.wait()
            decode_ready.clear()
            if stop.is_set():
                return
            decode_step()
            finished.set()

    finished, stop = threading.Event(), threading.Event()

    def run_decode():                   # turnstile step 2: D runs before the next P segment
        finished.clear()
        decode_ready.set()
        finished.wait()
    d = threading.Thread(target=d_executor)
    d.start()
    turnstile = Turnstile(ctx, run_decode)
    for r in range(int(rounds)):
        prompts = sequences(1000 * r + ctx.rank, rng.randint(1, 3), 3, 24)
        with ep_phase(model, "prefill"):
            for layers_done, out in model.forward_segments(*packed(prompts), layers_per_segment=1):
                if out is None:
                    if rng.random() < 0.6:  # a decode step becomes ready on this rank
                        requests.append(sequences(5000 * r + 7 * layers_done + ctx.rank, rng.randint(1, 2), 2, 9))
                    threading.Event().wait(rng.random() * 0.01)   # skew the ranks
                    turnstile.boundary(bool(requests))
                else:
                    done.append(("prefill", prompts, out.hidden))
    stop.set()
    decode_ready.set()
    d.join()
    worst, tokens_equal = 0.0, True
    for _, seqs, hidden in done:
        want = ref(*packed(seqs)).hidden
        worst = max(worst, float((hidden - want).abs().max()))
        tokens_equal &= torch.equal(model.logits(hidden).argmax(-1), ref.logits(want).argmax(-1))
    print(f"rounds {rounds}: {turnstile.boundaries} boundaries, {turnstile.decode_steps} decode steps, "
          f"{sum(k == 'decode' for k, _, _ in done)} real decodes here, max diff {worst:.3g}, "
          f"tokens equal {tokens_equal}", flush=True)
    if worst > 1e-10 or not tokens_equal:      # float64, hidden states O(1): measured 6.7e-16
        fail("outputs differ from the one-process model", 1)


def case_engine(*policies, naive: bool = False, queue: bool = True):
    """The distributed EP engine under each P/D policy: concurrent prefill and decode workers per rank
    (private groups, in-order collective queue, turnstile), requests arriving at different steps on
    each rank, random skew: greedy tokens equal the one-process engine's. ``queue=False``: the engine
    installs its own collective queue. ``naive``: the workers without the turnstile (each rank's D steps
    whenever it has decodes) — its collectives cross and the run fails."""
    from arbor.engine import EngineConfig, LLMEngine, SamplingParams
    ctx, model, ref = setup(phase_groups=True, queue=queue)
    prompts = sequences(30 + ctx.rank, 5 + ctx.rank, 3, 70)
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    for policy in policies:
        rng = random.Random(ctx.rank)
        cfg = dict(num_blocks=64, policy=policy, max_num_batched_tokens=48)
        engine = LLMEngine(model, EngineConfig(**cfg), ctx=ctx)
        engine.policy.runtime.ordered = not naive
        arrivals = sorted(rng.randint(0, 12) for _ in prompts)
        ids, step = [], 0
        while ctx.flags_max(float(engine.has_unfinished() or len(ids) < len(prompts)))[0]:
            while len(ids) < len(prompts) and arrivals[len(ids)] <= step:
                ids.append(engine.add_request(prompts[len(ids)], params[len(ids)]))
            threading.Event().wait(rng.random() * 0.005)     # skew the ranks
            try:
                engine.step()
            except (CollectiveError, TagMismatchError) as e:
                fail(f"{policy}: crossed P/D collectives: {e}")
            step += 1
        stats = engine.stats()
        engine.close()
        if (ctx.queue is None) == queue:      # close() removes only the queue the engine installed
            fail(f"{policy}: collective queue {'removed' if queue else 'left installed'} by close()", 1)
        got = [engine.pop_finished(r)[0].token_ids for r in ids]
        want = [c.token_ids for c in LLMEngine(ref, EngineConfig(**cfg)).generate(prompts, params)]
        print(f"{policy}: {len(prompts)} requests in {step} steps, {stats['boundaries']} boundaries, "
              f"{stats['decode_steps']} decode steps, {stats['boundary_decode_steps']} inside prefills, "
              f"equal {got == want}", flush=True)
        if got != want:
            fail(f"{policy}: distributed engine {got} != one-process engine {want}", 1)


def case_engine_own_queue(*policies):
    case_engine(*policies, queue=False)


def case_engine_naive(*policies):
    case_engine(*policies, naive=True)
    fail("the naive concurrent design ran without crossing", 1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    globals()[f"case_{sys.argv[1]}"](*sys.argv[2:])
    from arbor.distributed.context import leave
    leave(0)
