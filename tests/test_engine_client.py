"""Every engine front end implements the shared interface (``arbor.engine.client``): the streaming
ones ``EngineClient``, the stepped ones ``SteppedEngine``; the in-process ones generate the same
greedy tokens as ``LLMEngine`` and report ``stats()``."""

import asyncio
import inspect

import pytest
import torch

from arbor.cluster.remote_engine import RemoteEngine
from arbor.distributed import DistContext
from arbor.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from arbor.engine.client import EngineClient, SteppedEngine
from arbor.engine.rank_front import RankFront
from arbor.engine.threaded_engine import ThreadedAsyncLLMEngine
from arbor.models import CausalLM, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)).eval()


def engine(model, **kw):
    return LLMEngine(model, EngineConfig(num_blocks=64, block_size=4, **kw))


@pytest.fixture(scope="module")
def reference(model):
    return [c.token_ids for c in engine(model).generate(PROMPTS, GREEDY)]


async def streamed(client) -> list[list[int]]:
    async def one(prompt):
        last = None
        async for out in client.generate(prompt, GREEDY):
            last = out
        return last.token_ids
    async with client.session():
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def test_the_protocols_are_what_each_front_end_offers(model):
    eng = engine(model)
    assert isinstance(eng, SteppedEngine) and not isinstance(model, SteppedEngine)
    assert isinstance(RankFront(eng, DistContext.single()), SteppedEngine)
    assert isinstance(AsyncLLMEngine(eng), EngineClient) and AsyncLLMEngine(eng).engine is eng   # wrapped as is
    assert isinstance(ThreadedAsyncLLMEngine(engine(model)), EngineClient)
    assert issubclass(RemoteEngine, EngineClient)        # its instances need a Ray cluster (tests/test_cluster.py)
    for cls in (AsyncLLMEngine, ThreadedAsyncLLMEngine, RemoteEngine):      # streaming: an async iterator
        assert inspect.isasyncgenfunction(cls.generate)
    for cls in (LLMEngine, RankFront):
        assert not inspect.isasyncgenfunction(cls.generate) and not inspect.iscoroutinefunction(cls.generate)


@pytest.mark.parametrize("policy", ["mixed", "pd-multiplex"])
def test_every_in_process_front_end_generates_the_engine_tokens(model, reference, policy):
    eng = engine(model, policy=policy)
    assert [c.token_ids for c in eng.generate(PROMPTS, GREEDY)] == reference
    front = RankFront(engine(model, policy=policy), DistContext.single())
    assert [c.token_ids for c in front.generate(PROMPTS, GREEDY)] == reference and not front.requests
    assert asyncio.run(streamed(AsyncLLMEngine(engine(model, policy=policy)))) == reference
    assert asyncio.run(streamed(ThreadedAsyncLLMEngine(engine(model, policy=policy)))) == reference
    front = RankFront(engine(model, policy=policy), DistContext.single())
    assert asyncio.run(streamed(AsyncLLMEngine(front))) == reference


def test_stats_report_queues_kv_and_counters(model):
    eng = engine(model, policy="mixed")
    eng.add_request(PROMPTS[0], GREEDY)
    s = eng.stats()
    assert (s["policy"], s["requests"], s["waiting"], s["running"], s["num_steps"]) == ("mixed", 1, 1, 0, 0)
    assert s["kv_blocks"] == 64 and s["kv_blocks_free"] == 64 and s["kv_usage"] == 0
    eng.step()
    s = eng.stats()
    assert s["running"] == 1 and s["kv_usage"] > 0 and s["num_steps"] == 1
    # pd-multiplex adds its boundary counters (its decode worker runs beside the step, so the queues
    # after a step depend on timing: not compared here)
    pd = engine(model, policy="pd-multiplex")
    pd.add_request(PROMPTS[0], GREEDY)
    pd.step()
    s = pd.stats()
    assert s["policy"] == "pd-multiplex" and "boundary_decode_steps" in s and s["num_steps"] >= 1
    front = RankFront(engine(model), DistContext.single())
    front.add_request(PROMPTS[1], GREEDY)
    assert front.stats()["requests"] == 1 and front.stats()["load"] == [1]
    async_engine = AsyncLLMEngine(engine(model))
    assert async_engine.stats()["streams"] == 0 and async_engine.stats()["waiting"] == 0
    threaded = ThreadedAsyncLLMEngine(engine(model))
    assert threaded.stats()["streams"] == 0 and threaded.stats()["kv_usage"] == 0


def test_pd_multiplex_outputs_decoded_beside_the_step_keep_the_engine_unfinished(model):
    """D may finish a request between two steps: the scheduler drops it, but the next step still has its
    last tokens to return, so the engine is unfinished until then (else a threaded front waits forever)."""
    eng = engine(model, policy="pd-multiplex")
    eng.add_request(PROMPTS[0], GREEDY)
    returned = []
    while eng.has_unfinished():
        returned += eng.step()
    finished = list({id(s): s for s in returned}.values())     # a sequence is returned at each of its steps
    assert len(finished) == 1 and finished[0].is_finished
    runtime = eng.policy.runtime
    with runtime.lock:
        runtime.decoded.append(finished[0])      # as D leaves a sequence it finished after the last step
    assert not eng.scheduler.has_unfinished() and eng.has_unfinished()
    assert eng.step() == [finished[0]] and not eng.has_unfinished()
