"""Sampler and request features: log-probs, seeds, filters, n, stop ids/strings, routed experts,
weight updates."""

import copy

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.models import CausalLM, ModelConfig, VarlenAttention
from arbor.models.sampling import SamplingSpec
from arbor.models.tokenizer import builtin_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[(5 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate([4, 19, 35, 9])]


def tiny(moe=False, seed=0):
    torch.manual_seed(seed)
    extra = dict(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16) if moe else {}
    model = CausalLM(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8, **extra)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)   # peaked next-token distributions
    return model


@pytest.fixture(scope="module")
def model():
    return tiny()


def full_logprobs(model, ids, spec=SamplingSpec()):
    with torch.no_grad():
        hidden = model(torch.tensor(ids), VarlenAttention.from_lengths([len(ids)])).hidden
        return spec.logprobs(model.logits(hidden))


def assert_engine_logprobs(model, pairs, spec=SamplingSpec()):
    """pairs: (engine log-probs, ids, [(row, token)] they are of) → each equals the log-prob under a float64
    copy of ``model`` (the engine's float32 kernels have no float64 path) within 10× the float32 rounding of
    the same rows of log-probs by ``model`` itself (its largest error over their finite entries). Measured,
    default / AVX2 / kernels off: noise 2.5e-6 to 6.5e-6 (peaked logits), the engine 1.2e-6 to 5.2e-6 off."""
    exact_model = copy.deepcopy(model).double()
    got, want, noise = [], [], 0.0
    for values, ids, at in pairs:
        rows, toks = torch.tensor(at).T
        exact = full_logprobs(exact_model, ids, spec)[rows]
        own = full_logprobs(model, ids, spec)[rows].double()     # (a near-tie at the top-k / top-p edge may
        err = (own - exact)[exact.isfinite() & own.isfinite()]    # keep a token in one and not the other)
        noise = max(noise, float(err.abs().max()))
        got.append(torch.tensor(values, dtype=torch.float64))
        want.append(exact[torch.arange(len(toks)), toks])
    assert noise > 0
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=10 * noise, rtol=0)


@pytest.mark.parametrize("knobs", [dict(temperature=0.8, top_k=20), dict(temperature=0.7, top_p=0.9),
                                   dict(temperature=1.3, min_p=0.05), dict(temperature=1.0)])
def test_logprobs_are_those_of_the_distribution_sampled_from(model, knobs):
    """logits / T, truncated by top-k / top-p / min-p, renormalised: what the trainer recomputes."""
    engine = LLMEngine(model, EngineConfig(block_size=4))
    outs = engine.generate(PROMPTS, SamplingParams(**knobs, seed=1, max_tokens=10, ignore_eos=True, logprobs=3))
    spec = SamplingSpec(**knobs)
    pairs = []
    for o in outs:
        ids = o.prompt_token_ids + o.token_ids
        first = len(o.prompt_token_ids) - 1
        ref = full_logprobs(model, ids, spec)[first:-1]
        assert torch.isfinite(torch.tensor(o.logprobs)).all()          # a sampled token is never a dropped one
        pairs.append((o.logprobs, ids, [(first + i, t) for i, t in enumerate(o.token_ids)]))
        vals, idx = ref[0].topk(3)
        keep = vals > float("-inf")
        assert list(o.top_logprobs[0]) == idx[keep].tolist()
        pairs.append((list(o.top_logprobs[0].values()), ids, [(first, t) for t in o.top_logprobs[0]]))
    assert_engine_logprobs(model, pairs, spec)


def test_greedy_logprobs_are_the_models_own_distribution(model):
    out = LLMEngine(model, EngineConfig()).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5,
                                                                                ignore_eos=True))[0]
    first = len(out.prompt_token_ids) - 1
    assert_engine_logprobs(model, [(out.logprobs, out.prompt_token_ids + out.token_ids,
                                    [(first + i, t) for i, t in enumerate(out.token_ids)])])


def test_seeded_sampling_is_independent_of_the_batch(model):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    alone = LLMEngine(model, EngineConfig()).generate([PROMPTS[1]], p)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.5, seed=3, max_tokens=3, ignore_eos=True)]
    for cfg in (dict(), dict(num_blocks=6, block_size=8), dict(max_num_batched_tokens=5, policy="prefill-first")):
        outs = LLMEngine(model, EngineConfig(**cfg)).generate(PROMPTS[:1] + [PROMPTS[1]] + PROMPTS[2:],
                                                              [others[0], p, others[1], others[2]])
        assert outs[1].token_ids == alone


def test_n_samples_share_the_prompt_and_match_single_seeds(model):
    engine = LLMEngine(model, EngineConfig(block_size=4))
    outs = engine.generate([PROMPTS[2]], SamplingParams(n=4, temperature=1.0, seed=10, max_tokens=8, ignore_eos=True))
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert all(o.num_cached_tokens == 32 for o in outs[1:])
    assert len({tuple(o.token_ids) for o in outs}) > 1
    for j, o in enumerate(outs):
        single = LLMEngine(model, EngineConfig()).generate(
            [PROMPTS[2]], SamplingParams(temperature=1.0, seed=10 + j, max_tokens=8, ignore_eos=True))[0]
        assert single.token_ids == o.token_ids


def test_filters_restrict_the_support(model):
    engine = LLMEngine(model, EngineConfig())
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        outs = engine.generate(PROMPTS, SamplingParams(temperature=1.5, max_tokens=6, ignore_eos=True, **params))
        assert [o.token_ids for o in outs] == [g.token_ids for g in greedy]
    lp = full_logprobs(model, PROMPTS[0])[-1]
    outs = engine.generate([PROMPTS[0]], SamplingParams(n=64, temperature=3.0, top_k=3, max_tokens=1, seed=0))
    firsts = {o.token_ids[0] for o in outs}
    assert firsts <= set(lp.topk(3).indices.tolist()) and len(firsts) > 1


def test_sampling_frequencies_follow_the_distribution():
    model = tiny(seed=1)
    with torch.no_grad():
        model.lm_head.weight.div_(10)
    engine = LLMEngine(model, EngineConfig())
    outs = engine.generate([PROMPTS[0]], SamplingParams(n=400, temperature=1.0, max_tokens=1))
    probs = full_logprobs(model, PROMPTS[0])[-1].exp()
    top = probs.topk(3).indices
    freq = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=128).float() / 400
    assert (freq[top] - probs[top]).abs().max() < 0.06


def test_stop_token_ids_eos_and_max_tokens(model):
    engine = LLMEngine(model, EngineConfig())
    ref = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    stop = ref[3]
    first = ref.index(stop)
    out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    model.config.eos_token_id = stop
    try:
        out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10))[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == stop
        out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
        assert out.token_ids == ref and out.finish_reason == "length"
    finally:
        model.config.eos_token_id = None


def test_stop_strings_cut_the_text(model):
    tok = builtin_tokenizer()
    engine = LLMEngine(model, EngineConfig(), tokenizer=tok)
    full = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert full.text == tok.decode(full.token_ids)
    stop = full.text[4:6]
    out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.find(stop)]


def test_routed_experts_match_the_model_routing():
    model = tiny(moe=True)
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=8))
    outs = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                       return_routed_experts=True))
    for o in outs:
        ids = o.prompt_token_ids + o.token_ids
        with torch.no_grad():
            ref = model(torch.tensor(ids), VarlenAttention.from_lengths([len(ids)]), return_routing=True).routed_experts
        assert o.routed_experts.shape == (2, 6, 2)
        fed = ref[:, len(o.prompt_token_ids):len(ids) - 1]
        assert torch.equal(o.routed_experts[:, :-1].sort(-1).values, fed.sort(-1).values)
        assert (o.routed_experts[:, -1] == -1).all()


def test_update_weights_in_place(model):
    engine = LLMEngine(model, EngineConfig(dtype="bfloat16"))
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = [o.token_ids for o in engine.generate(PROMPTS, p)]
    new = tiny(seed=5)
    ptr = engine.model.lm_head.weight.data_ptr()
    assert engine.update_weights(new.state_dict()) >= 0
    assert engine.model.lm_head.weight.data_ptr() == ptr
    after = [o.token_ids for o in engine.generate(PROMPTS, p)]
    fresh = [o.token_ids for o in LLMEngine(new, EngineConfig(dtype="bfloat16")).generate(PROMPTS, p)]
    assert after == fresh != before
    with pytest.raises(KeyError):
        engine.update_weights({"nope": torch.zeros(1)})


def test_bad_requests_raise(model):
    engine = LLMEngine(model, EngineConfig(max_model_len=64))
    for prompt in ([], [128], list(range(64))):
        with pytest.raises(ValueError):
            engine.add_request(prompt)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=-1)
    out = engine.generate([list(range(60))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_all_greedy_batch_samples_like_a_mixed_one_bit_for_bit():
    """The all-greedy shortcut of the sampler gives the general path's tokens and log-probs exactly."""
    from arbor.engine.sampler import Sampler
    from arbor.engine.sequence import Sequence
    torch.manual_seed(0)
    logits = torch.randn(5, 64) * 4
    greedy = SamplingParams(temperature=0, max_tokens=4)
    seqs = [Sequence(str(i), 0, [1, 2], greedy, frozenset(), 4) for i in range(5)]
    fast = Sampler()(logits, seqs)
    hot = Sequence("x", 0, [1, 2], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4, seed=1), frozenset(), 4)
    general = Sampler()(torch.cat([logits, logits[:1]]), seqs + [hot])
    assert fast[0] == general[0][:5] and fast[1] == general[1][:5] and fast[2] == [None] * 5


def test_untruncated_rows_sample_like_the_filtering_path_bit_for_bit():
    """Rows without top-k / top-p / min-p (and greedy rows) skip ``processed_logprobs``' knob tensors:
    the tokens of the general path (a truncating row in the batch) and, bit for bit, the log-probs
    ``processed_logprobs`` gives these rows (what the trainer recomputes: ``SamplingSpec.logprobs``)."""
    from arbor.engine.sampler import Sampler
    from arbor.engine.sequence import Sequence
    from arbor.models.sampling import processed_logprobs
    torch.manual_seed(0)
    logits = torch.randn(6, 64) * 4
    params = [SamplingParams(temperature=t, seed=s, max_tokens=4) for t, s in
              [(0.7, 1), (1.3, None), (0.0, None), (0.7, 2), (1.0, 5), (0.5, None)]]
    seq = lambda p, i: Sequence(str(i), 0, [1, 2], p, frozenset(), 4)
    fast = Sampler(3)(logits, [seq(p, i) for i, p in enumerate(params)])
    cut = SamplingParams(temperature=0.9, top_k=5, max_tokens=4)     # forces the general path
    general = Sampler(3)(torch.cat([logits, logits[:1]]), [seq(p, i) for i, p in enumerate(params + [cut])])
    assert fast[0] == general[0][:6]
    t = torch.tensor([p.temperature for p in params])
    want = processed_logprobs(logits, t, torch.full((6,), -1), torch.ones(6), torch.zeros(6))
    assert fast[1] == want[torch.arange(6), torch.tensor(fast[0])].tolist()
    assert fast[0][2] == int(logits[2].argmax())          # the greedy row
