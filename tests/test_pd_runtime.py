"""The concurrent P/D runtime in one process (``arbor.engine.policies.pd_runtime``): prefill and decode
workers really overlap, with their own thread budgets, and give the tokens of a one-forward policy;
the collective queue's reservation; the per-thread KV gather buffer; ``pd_threads`` validation.
(The 2-rank cases — turnstile, naive crossing — are in tests/test_pd_multiplex.py, in child processes.)"""

import threading

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.engine.kv.paged import KVCache
from arbor.engine.policies.device_queue import DeviceQueue
from arbor.kernels.threads import thread_budget
from arbor.models import CausalLM, ModelConfig

TINY = dict(architecture="Qwen3ForCausalLM", vocab_size=128, hidden_size=128, intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(**TINY)).eval()


def drive(engine, prompts, params):
    """Requests arrive while earlier ones decode (long prompts late), so prefills meet decodes."""
    ids, out, step = [], {}, 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        if len(ids) < len(prompts) and step % 3 == 0:
            ids.append(engine.add_request(prompts[len(ids)], params))
        for seq in engine.step():
            if seq.is_finished:
                out[seq.request_id] = engine.pop_finished(seq.request_id)[0].token_ids
        step += 1
    return [out[r] for r in ids]


def overlaps(timeline) -> int:
    """Pairs (decode forward, prefill segment) whose time intervals intersect."""
    d = [(a, b) for p, a, b, _ in timeline if p == "decode"]
    p = [(a, b) for ph, a, b, _ in timeline if ph == "prefill"]
    return sum(a < b2 and a2 < b for a, b in d for a2, b2 in p)


@pytest.mark.parametrize("policy", ["pd-multiplex", "pd-global-enqueue"])
def test_prefill_and_decode_workers_overlap_and_equal_mixed(model, policy):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in [8, 12, 300, 9, 400, 350, 10, 380]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = drive(LLMEngine(model, EngineConfig(policy="mixed", max_num_batched_tokens=512)), prompts, params)
    saved = torch.get_num_threads()
    engine = LLMEngine(model, EngineConfig(policy=policy, max_num_batched_tokens=512, pd_threads="2,1"))
    rt = engine.policy.runtime
    assert rt.prefill.run(thread_budget) == 2 and rt.decode.run(thread_budget) == 1   # each worker its budget
    assert rt.prefill.run(torch.get_num_threads) == 2       # ATen's global count: P's (set last)
    engine.timeline = []
    got = drive(engine, prompts, params)
    engine.close()
    assert got == want
    assert torch.get_num_threads() == saved                 # close() gives the caller's count back
    for worker in (rt.prefill, rt.decode):
        worker.thread.join(5)
        assert not worker.thread.is_alive()                 # close() stops both workers
    assert overlaps(engine.timeline) > 0, engine.timeline    # D computed while P computed
    stats = engine.stats()
    if policy == "pd-global-enqueue":                       # D admitted at epoch starts only
        assert stats["boundary_decode_steps"] == 0 and stats["decode_steps"] > 0


def test_device_queue_reservation_orders_the_holder_first():
    q, ran = DeviceQueue("test"), []
    holder_go, main_submitted = threading.Event(), threading.Event()

    def holder():
        holder_go.wait()
        q.run(lambda: ran.append("D"))
        q.release()
    t = threading.Thread(target=holder)
    t.start()
    q.reserve(t)
    with pytest.raises(RuntimeError, match="already held"):
        q.reserve(threading.current_thread())
    waiter = threading.Thread(target=lambda: (q.run(lambda: ran.append("P")), main_submitted.set()))
    waiter.start()
    assert not main_submitted.wait(0.2)         # P's submission waits while D holds the queue
    holder_go.set()
    t.join(5)
    waiter.join(5)
    assert ran == ["D", "P"] and not q.held
    q.close()


def test_kv_gather_buffers_are_per_thread():
    cache = KVCache(1, 8, 4, 2, 8, torch.float32, "cpu")
    cache.k.normal_()
    blocks = torch.tensor([3, 1])
    seen = {}

    def gather(name):
        k, _ = cache.gather_blocks(0, blocks)
        seen[name] = k
    t = threading.Thread(target=gather, args=("other",))
    t.start()
    t.join()
    gather("main")
    assert seen["main"].data_ptr() != seen["other"].data_ptr()
    assert torch.equal(seen["main"], seen["other"])
    assert torch.equal(seen["main"][:4], cache.k[0, 12:16])


@pytest.mark.parametrize("value", ["1", "0,1", "a,b", "1,1,1", "2,-1", ""])
def test_pd_threads_is_validated(value):
    with pytest.raises(ValueError, match="pd_threads must be 'P,D'"):
        EngineConfig(policy="pd-multiplex", pd_threads=value)
    with pytest.raises(ValueError, match="pd_threads must be 'P,D'"):
        EngineConfig(policy="mixed", pd_threads=value)     # validated whatever the policy
