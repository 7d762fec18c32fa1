"""Block manager (prefix caching, ref counts, reuse) and scheduler (budget, policies) invariants."""

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.engine.block_manager import BlockManager
from arbor.engine.scheduler import Scheduler
from arbor.engine.sequence import Sequence
from arbor.models import CausalLM, ModelConfig


pytestmark = pytest.mark.usefixtures("one_thread")


def seq(tokens):
    return Sequence("r", 0, tokens, SamplingParams(), frozenset(), 16)


def computed(bm, s):
    bm.allocate(s)
    s.num_computed_tokens = len(s)
    bm.commit(s)
    return s


def test_prefix_hit_shares_blocks_and_never_the_last_token():
    bm = BlockManager(8, 4)
    a = computed(bm, seq(list(range(10))))          # blocks: [0..3] [4..7] [8 9]
    b = seq(list(range(8)))                          # two full blocks, but the last token is computed
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert bm.blocks[a.block_table[0]].ref_count == 2 and bm.blocks[b.block_table[1]].ref_count == 1
    c = seq(list(range(9)))
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[1]].ref_count == 2


def test_freed_blocks_stay_cached_until_reallocated():
    bm = BlockManager(4, 4)
    a = computed(bm, seq(list(range(9))))
    table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and all(bm.blocks[i].ref_count == 0 for i in table)
    b = seq(list(range(9)))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == table[:2]
    bm.deallocate(b)
    other = computed(bm, seq([50 + i for i in range(16)]))  # takes every block, oldest-freed first
    assert sorted(other.block_table) == [0, 1, 2, 3]
    bm.deallocate(other)
    c = seq(list(range(9)))
    bm.allocate(c)
    assert c.num_cached_tokens == 0


def test_hit_needs_matching_tokens():
    bm = BlockManager(8, 4)
    a = computed(bm, seq(list(range(9))))
    bm.blocks[a.block_table[0]].token_ids = [9, 9, 9, 9]   # what a hash collision would look like
    b = seq(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    computed(bm, seq(list(range(9))))
    b = seq(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not bm.hash_to_block


def tiny_engine(**kw):
    torch.manual_seed(0)
    return LLMEngine(CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8)).eval(),
                     EngineConfig(**kw))


def run_steps(engine):
    """Drive the engine, recording each step's schedule as [(num tokens, is a decode)]."""
    steps = []
    sched = engine.scheduler
    original = sched.schedule

    def recording():
        batch = original()
        steps.append([(n, s.num_output_tokens > 0) for s, n in batch])
        assert len(sched.running) <= sched.max_num_seqs
        return batch

    sched.schedule = recording
    while engine.has_unfinished():
        engine.step()
    return steps


def add(engine, lengths, new=6):
    for i, n in enumerate(lengths):
        engine.add_request([(7 * i + j) % 64 for j in range(n)], SamplingParams(temperature=0, max_tokens=new,
                                                                               ignore_eos=True))


def test_token_budget_and_prefill_first_steps_are_pure():
    engine = tiny_engine(max_num_batched_tokens=10, policy="prefill-first", block_size=4)
    add(engine, [3, 25, 8, 1])
    steps = run_steps(engine)
    assert all(sum(n for n, _ in s) <= 10 for s in steps)
    assert all(len({d for _, d in s}) == 1 for s in steps)          # all-prefill or all-decode
    assert max(n for s in steps for n, _ in s) == 10                 # the 25-token prompt was chunked
    assert engine.scheduler.num_preemptions == 0


def test_mixed_policy_puts_decodes_and_chunks_in_one_forward():
    engine = tiny_engine(max_num_batched_tokens=8, policy="mixed", block_size=4)
    add(engine, [2, 30], new=8)
    steps = run_steps(engine)
    assert all(sum(n for n, _ in s) <= 8 for s in steps)
    assert any(len({d for _, d in s}) == 2 for s in steps)           # decodes and a chunk together


def test_scheduler_rejects_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        Scheduler(BlockManager(4, 4), 4, 16, policy="fifo")


@pytest.mark.parametrize("policy", ["mixed", "prefill-first"])
def test_requests_with_one_prompt_compute_its_blocks_once(policy):
    """Four separate requests with one 22-token prompt and one other prompt, queued together: the first
    computes the prompt's 5 full blocks (block size 4; the last token is always computed), the other three
    wait one step for them to be committed and hit them, while the other prompt is admitted beside the
    first; greedy tokens equal those of an engine without prefix caching."""
    prompt, other = [(3 * j + 1) % 64 for j in range(22)], [(5 * j + 2) % 64 for j in range(9)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine = tiny_engine(policy=policy, block_size=4)
    for p in (prompt, prompt, other, prompt, prompt):
        engine.add_request(p, params)
    steps = run_steps(engine)
    assert steps[0] == [(22, False), (9, False)]                   # the first of each prompt
    assert sorted(n for n, decode in steps[1] + steps[2] if not decode) == [2, 2, 2]   # 22 − 5·4 each
    outs = [engine.requests[r][0] for r in engine.requests]
    assert [s.num_cached_tokens for s in outs] == [0, 20, 0, 20, 20]
    plain = tiny_engine(policy=policy, block_size=4, enable_prefix_caching=False)
    want = plain.generate([prompt, other], params)
    assert [s.output_ids for s in outs] == [want[i].token_ids for i in (0, 0, 1, 0, 0)]


def test_a_prompt_block_in_flight_is_waited_for_until_committed_or_released():
    bm = BlockManager(16, 4)
    a, b, c = seq(list(range(10))), seq(list(range(10))), seq(list(range(8)) + [60, 61])
    bm.allocate(a)                                   # computing blocks [0..3] [4..7]
    assert bm.waits_for_prefill(b) and bm.waits_for_prefill(c)
    a.num_computed_tokens = 4
    bm.commit(a)                                     # [0..3] committed: b and c hit it, [4..7] still in flight
    assert bm.waits_for_prefill(b) and bm.waits_for_prefill(c)
    bm.deallocate(a)                                 # preempted before [4..7]: nothing to wait for
    assert not bm.waits_for_prefill(b) and not bm.prefilling
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and bm.waits_for_prefill(c)
    assert not bm.waits_for_prefill(seq([9, 9, 9, 9, 9]))
