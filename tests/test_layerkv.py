"""Layer-wise KV (two tiers, offload/prefetch, SLO-aware admission): greedy outputs equal the
single-tier engine's (dense, MoE, hybrid), under demotion, preemption and prefix-cache hits on
offloaded blocks; tier accounting; the KV a decode reads; the admission rule; knob validation.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.kernels import cpu_attention
from arbor.engine.sequence import Sequence, SequenceStatus
from arbor.models import load_model
from tests.conftest import hf_model

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 10


def prompts(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 17, 33, 1, 40, 61)]
    out.append(out[2][:20] + [3, 4, 5])   # shares a prefix block with prompt 2
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "qwen3_next"])
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(folder)
    model = load_model(folder)
    ps = prompts(model.config.vocab_size)
    if request.param == "qwen3_next":   # its long prompts sit on near-ties that batch shapes flip
        ps = ps[:4] + ps[6:]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(model, EngineConfig(block_size=8)).generate(ps, params)]
    return request.param, model, ps, params, ref


CONFIGS = {
    "roomy": dict(device_kv_blocks=4096),                                   # every layer stays resident
    "tight": dict(device_kv_blocks=48),                                      # demotions, staged layers
    "tight-chunked": dict(device_kv_blocks=40, max_num_batched_tokens=9),
    "preemption": dict(device_kv_blocks=20),                                 # staging alone overflows
    "prefill-first": dict(device_kv_blocks=40, policy="prefill-first"),
}


def checked_run(engine, ps, params):
    """generate, checking the tier accounting after every step."""
    for p in ps:
        engine.add_request(p, params)
    bm = engine.block_manager
    while engine.has_unfinished():
        engine.step()
        bm.device.check()
        owned = {b for s in engine.scheduler.running for b in s.block_table}
        assert not owned & set(bm.free), "a host block is both free and owned"
        assert all(bm.blocks[b].ref_count > 0 for b in owned)
    return [c.token_ids for rid in list(engine.requests) for c in engine.pop_finished(rid)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_single_tier(case, name):
    """Against the single-tier engine with the same scheduling knobs (same chunks, same numerics)."""
    kind, model, ps, params, ref = case
    same = {k: v for k, v in CONFIGS[name].items() if k != "device_kv_blocks"}
    if same:
        ref = [o.token_ids for o in LLMEngine(model, EngineConfig(block_size=8, **same)).generate(ps, params)]
    knobs = dict(CONFIGS[name])
    if kind == "qwen3_next":     # one attention layer of four: a quarter of the tier is as tight
        knobs["device_kv_blocks"] = max(12, knobs["device_kv_blocks"] // 4)
    engine = LLMEngine(model, EngineConfig(block_size=8, layer_kv=True, **knobs))
    assert checked_run(engine, ps, params) == ref
    dev, copier = engine.block_manager.device, engine.layer_kv.copier
    assert dev.used == 0 and not dev.tables and not dev.stale
    if name == "roomy":      # every layer stays resident: nothing offloaded; cached blocks written back at release
        assert copier.bytes["offload"] == 0 and copier.bytes["writeback"] > 0
    else:                    # (one attention layer: resident whenever admitted, so nothing offloaded)
        assert copier.bytes["offload"] > 0 or kind == "qwen3_next"
        assert copier.bytes["prefetch"] > 0
        assert dev.num_demotions > 0 or kind == "qwen3_next"     # one attention layer: nothing to demote
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0
    # a second pass hits the prefix cache; under a tight tier the hit blocks are offloaded ones
    again = checked_run(engine, ps, params)
    assert again == ref
    assert engine.block_manager.num_hit_tokens > 0


def test_gather_sdpa_decode_path(case, monkeypatch):
    """The paged-attention path of every device (gather the blocks, then SDPA) over staged blocks."""
    monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    monkeypatch.setattr(cpu_attention, "supports_prefill", lambda *a: False)
    kind, model, ps, params, ref = case
    engine = LLMEngine(model, EngineConfig(block_size=8, layer_kv=True, device_kv_blocks=48))
    assert checked_run(engine, ps, params) == ref


def test_hits_on_offloaded_blocks_are_prefetched(case):
    """With a device tier that cannot keep every layer, a prompt whose head is cached reads the
    cached KV of its offloaded layers through prefetches, and decodes what the single-tier engine decodes."""
    kind, model, ps, params, ref = case
    engine = LLMEngine(model, EngineConfig(block_size=8, layer_kv=True, device_kv_blocks=12, max_num_seqs=1))
    assert checked_run(engine, ps[:3], params) == ref[:3]
    before = engine.layer_kv.copier.bytes["prefetch"]
    prompt = ps[2][:32] + [3, 4, 5, 6]
    want = LLMEngine(model, EngineConfig(block_size=8)).generate([prompt], params)[0].token_ids
    engine.add_request(prompt, params)
    engine.step()                                    # the prefill: 32 of its 36 tokens cached
    seq = engine.requests[next(iter(engine.requests))][0]
    assert seq.num_cached_tokens == 32
    if kind != "qwen3_next":                         # (one attention layer: it stays resident, filled from the host)
        assert engine.block_manager.device.resident_layers(seq) < engine.layer_kv.num_layers
    assert engine.layer_kv.copier.bytes["prefetch"] > before
    while engine.has_unfinished():
        engine.step()
    assert [c.token_ids for c in engine.pop_finished(seq.request_id)] == [want]


def test_decode_reads_the_kv_written_at_prefill():
    """The device blocks a decode attends over (staged from the host tier, or resident) hold, layer
    by layer, the KV the single-tier engine's cache holds for the same tokens."""
    torch.manual_seed(0)
    model = load_model_tiny()
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    single = LLMEngine(model, EngineConfig(block_size=8))
    tiered = LLMEngine(model, EngineConfig(block_size=8, layer_kv=True, device_kv_blocks=16))
    for e in (single, tiered):
        e.add_request(prompt, params)
        e.step()                                      # prefill + first token
    s1 = single.scheduler.running[0]
    s2 = tiered.scheduler.running[0]
    assert tiered.block_manager.device.resident_layers(s2) < len(tiered.runner.layer_map)   # some layers staged
    runner = tiered.runner
    attn = runner.attention([s2], [s2.num_computed_tokens], [1])
    try:
        bs = 8
        n = -(-s2.num_computed_tokens // bs)
        for a in range(len(runner.layer_map)):
            job = attn.jobs[a] if a < 2 else attn._prefetch(a)
            runner.tiers.copier.wait(job)
            table = attn.layers[a].decode_kernel[0][0].tolist() if attn.layers[a].decode_kernel is not None \
                else attn.layers[a].decodes[0].blocks.tolist()
            head, c = runner.pool.k.shape[2:], s2.num_computed_tokens
            for kind in ("k", "v"):
                pool, ref = getattr(runner.pool, kind)[a], getattr(single.runner.kv, kind)[a]
                staged = pool.view(-1, bs, *head)[table[:n]].reshape(-1, *head)
                want = ref.view(-1, bs, *head)[s1.block_table[:n]].reshape(-1, *head)
                assert torch.equal(staged[:c], want[:c]), f"layer {a} {kind}"
    finally:
        attn.finish()
    tiered.block_manager.device.check()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_resident_layers_are_not_written_through(prefix_caching):
    """4 layers, blocks of 8, a 37-token prompt, 4 greedy tokens (40 computed tokens, 5 blocks), a device
    tier of 18 layer-blocks: the sequence keeps layer 0 resident throughout (5 + staging 2·5 = 15 ≤ 18;
    two layers would need 20, as would all four). Only layers 1–3 go to the host while it runs (40
    tokens each); at release, with prefix caching, the 5 cached blocks of layer 0 are written back once
    (40 tokens), and without it nothing is."""
    torch.manual_seed(0)
    model = load_model_tiny()
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = LLMEngine(model, EngineConfig(block_size=8)).generate([prompt], params)[0].token_ids
    engine = LLMEngine(model, EngineConfig(block_size=8, layer_kv=True, device_kv_blocks=18,
                                           enable_prefix_caching=prefix_caching))
    lkv, dev = engine.layer_kv, engine.block_manager.device
    engine.add_request(prompt, params)
    seen = []
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:          # while it runs: layer 0 is never written to the host
            seen.append(dev.resident_layers(s))
            assert lkv.host_write_tokens == [0] + [s.num_computed_tokens] * 3
    assert set(seen) == {1}
    assert [c.token_ids for rid in list(engine.requests) for c in engine.pop_finished(rid)] == [want]
    token_bytes = 2 * model.config.num_key_value_heads * model.config.head_dim * 4      # k and v, float32
    assert lkv.copier.bytes["offload"] == 3 * 40 * token_bytes                         # layers 1–3 only
    written = 40 if prefix_caching else 0
    assert lkv.host_write_tokens == [written, 40, 40, 40]
    assert lkv.copier.bytes["writeback"] == written * token_bytes
    assert not dev.stale and dev.used == 0


def test_admission_predicts_the_uncached_tokens():
    """The hand-made setting below (1 ms/token, slack 0.4 s, α = 1.2: 333 tokens fit) with a 400-token
    prompt whose first 320 tokens are in the prefix cache: its forward computes 80 tokens (0.096 s with
    α), so it is admitted; a 400-token prompt with nothing cached is not."""
    from arbor.engine.policies.slo_admission import PrefillTimeModel
    engine = LLMEngine(load_model_tiny(), EngineConfig(layer_kv=True, policy="layerkv", tpot_slo=0.1,
                                                       slo_safety=1.2))
    head = [(7 * i) % 64 for i in range(320)]
    engine.generate([head + [1, 2, 3]], SamplingParams(temperature=0, max_tokens=1))   # caches 20 blocks of 16
    timing = engine.layer_kv.timing = PrefillTimeModel()
    for n in (100, 200, 300):
        timing.observe(n, 0, n / 1000)
    now = 1000.0
    sched = engine.scheduler
    sched.running.append(running_decode(now))

    def waiting(tokens):
        s = Sequence("w", 0, tokens, SamplingParams(), frozenset(), 4)
        s.arrival = now
        return s

    hit = waiting(head + [5] * 80)
    assert engine.block_manager.cached_tokens(hit) == 320
    assert sched.policy.admissible(sched, hit, now)
    assert not sched.policy.admissible(sched, waiting([5] * 400), now)
    sched.running.clear()


def running_decode(now):
    """A decode with 4 tokens after its first, 10 to go, 1 s since its first token (slack 0.4 s at TPOT SLO 0.1 s)."""
    running = Sequence("r", 0, [1, 2, 3, 4], SamplingParams(max_tokens=15), frozenset(), 15)
    for t in range(5):
        running.append(5 + t, 0.0, None)
    running.num_computed_tokens = len(running) - 1
    running.first_token_time = now - 1.0
    running.status = SequenceStatus.RUNNING
    return running


def test_copier_keeps_submission_order():
    """A copy small enough to run inline waits for the worker's queued jobs (it may read what they write)."""
    import threading
    from arbor.engine.kv.transfer import Copier
    copier, order, gate = Copier("cpu", inline_bytes=1 << 20), [], threading.Event()
    big = copier.submit(lambda: (gate.wait(5), order.append("big")), 1 << 30, "offload")
    small = copier.submit(lambda: order.append("small"), 1, "prefetch")
    gate.set()
    copier.wait(big)
    copier.wait(small)
    copier.close()
    assert order == ["big", "small"]


def load_model_tiny():
    from arbor.models import CausalLM, ModelConfig
    return CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8,
                                num_hidden_layers=4)).eval()


def test_admission_refuses_a_prefill_longer_than_the_smallest_slack():
    """Hand-made: prefill time 1 ms/token (fitted), TPOT SLO 0.1 s, a decode with 4 tokens after its
    first, 10 to go, 1 s since its first token → slack 0.1·14 − 1 = 0.4 s; α = 1.2 admits 300 tokens
    (0.36 s) and refuses 400 (0.48 s)."""
    engine = LLMEngine(load_model_tiny(), EngineConfig(layer_kv=True, policy="layerkv", tpot_slo=0.1,
                                                       slo_safety=1.2))
    timing = engine.layer_kv.timing
    timing.observe(100, 0, 0.1)
    timing.observe(200, 0, 0.2)
    timing.observe(300, 0, 0.3)
    assert timing.prefill(300) == pytest.approx(0.3) and timing.decode_step(1) == pytest.approx(0.0, abs=1e-9)
    now = 1000.0
    sched = engine.scheduler
    sched.running.append(running_decode(now))
    policy = sched.policy

    def waiting(n):
        s = Sequence("w", 0, list(range(n)), SamplingParams(), frozenset(), 4)
        s.arrival = now
        return s

    assert policy.admissible(sched, waiting(300), now)
    assert not policy.admissible(sched, waiting(400), now)
    engine.layer_kv.ttft_slo = 0.5                      # a request late for its TTFT SLO is admitted anyway
    late = waiting(400)
    late.arrival = now - 1.0
    assert policy.admissible(sched, late, now)
    sched.running.clear()


def test_slo_policy_defers_prefills_and_keeps_outputs(case):
    """With decodes running that can keep their TPOT SLO and a safety factor that makes every prefill
    too long for their slack, later prefills wait until the decodes finish; outputs stay those of the
    single-tier engine."""
    kind, model, ps, params, _ = case
    ref = [o.token_ids for o in LLMEngine(model, EngineConfig(block_size=8, max_num_batched_tokens=16)).generate(
        ps, params)]
    engine = LLMEngine(model, EngineConfig(block_size=8, layer_kv=True, device_kv_blocks=48, policy="layerkv",
                                           max_num_batched_tokens=16, tpot_slo=1.0, slo_safety=1e6))
    first = [engine.add_request(p, params) for p in ps[:2]]
    while not (engine.layer_kv.timing.ready and all(s.num_output_tokens for s in engine.scheduler.running)):
        engine.step()
    rest = [engine.add_request(p, params) for p in ps[2:]]
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.device.check()
    assert [engine.pop_finished(r)[0].token_ids for r in first + rest] == ref
    assert engine.layer_kv.num_deferrals > 0


@pytest.mark.parametrize("kw, match", [
    (dict(layer_kv=1), "layer_kv"),
    (dict(layer_kv=True, device_kv_blocks=1), "device_kv_blocks"),
    (dict(layer_kv=True, host_kv_blocks=0), "host_kv_blocks"),
    (dict(layer_kv=True, tpot_slo=0), "tpot_slo"),
    (dict(layer_kv=True, ttft_slo=-1.0), "ttft_slo"),
    (dict(layer_kv=True, slo_safety=0.5), "slo_safety"),
    (dict(policy="layerkv", tpot_slo=0.1), "needs layer_kv"),
    (dict(policy="layerkv", layer_kv=True), "needs tpot_slo"),
    (dict(policy="pd-multiplex", layer_kv=True), "does not combine"),
])
def test_bad_knobs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_tier_accounting_by_hand():
    """Device tier of 20 layer-blocks, 4 layers, blocks of 4 tokens, 9-token prompts (3 blocks each).
    a keeps all 4 layers (12 blocks, no staging); b gets 0 layers (its 6 staging blocks fit the 8
    left); c's staging needs a demoted entirely (reserve 18); d cannot come in (2 · 12 > 20);
    when a leaves, b is promoted to 2 layers and its computed blocks are queued as fills."""
    from types import SimpleNamespace

    from arbor.engine.kv.tiers import DeviceTier, TieredBlockManager
    tier = DeviceTier(20, 4, 4)
    bm = TieredBlockManager(16, 4, tiers=SimpleNamespace(device=tier))

    def seq(first):
        return Sequence("r", 0, list(range(first, first + 9)), SamplingParams(), frozenset(), 4)

    def owned():
        return [x for t in tier.tables.values() for layer in t for x in layer]

    a, b, c, d = seq(0), seq(20), seq(40), seq(60)
    bm.allocate(a)
    assert (tier.resident_layers(a), tier.resident, tier.reserve, tier.budget()) == (4, 12, 0, 8)
    bm.allocate(b)
    assert (tier.resident_layers(b), tier.reserve, tier.budget()) == (0, 6, 2)
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert (tier.resident_layers(a), tier.resident_layers(c), tier.reserve, tier.num_demotions) == (0, 0, 18, 4)
    tier.check()
    assert not set(owned()) & set(tier.free) and len(owned()) + len(tier.free) == 20
    assert not bm.can_allocate(d)
    b.num_computed_tokens = 9
    bm.deallocate(a)
    assert tier.reserve == 12 and tier.promote() == 2 and tier.resident_layers(b) == 2
    fills = sorted((f[1], f[3]) for f in tier.pending_fills)
    assert fills == sorted((layer, h) for layer in (0, 1) for h in b.block_table)
    tier.check()
    for s_ in (b, c):
        bm.deallocate(s_)
    tier.check()
    assert tier.used == 0 and tier.reserve == 0 and not tier.pending_fills and not owned()
