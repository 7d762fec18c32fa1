"""Block-diffusion decoding: exact block cache, the M2T/T2T rule replayed against an independent
no-cache forward, editing on/off semantics, forward counting, baselines, batching.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import pytest
import torch

from arbor.dllm.decoding import DecodeConfig, diffusion_generate, quality, speed, transfer_counts
from arbor.models import BlockDiffusionAttention, CausalLM, ModelConfig

MASK, EOS, V = 31, 0, 32


def tiny_model(block_size=4, seed=0, scale=0.5):
    torch.manual_seed(seed)
    cfg = ModelConfig(architecture="ArborBlockDiffusionForCausalLM", vocab_size=V, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, mask_token_id=MASK, block_size=block_size, eos_token_id=EOS)
    model = CausalLM(cfg).eval()
    with torch.no_grad():                       # spread the confidences over (0, 1)
        for p in model.parameters():
            p.normal_(0, scale)
    return model


def reference_conf_pred(model, seq: list[int], start: int, end: int):
    """(p, x̂) at positions [start, end) from a full forward of seq[:end] (no cache)."""
    ids = torch.tensor(seq[:end])
    with torch.no_grad():
        logits = model.logits(model(ids, BlockDiffusionAttention.from_lengths([end], model.config.block_size)).hidden)
    logits[:, MASK] = float("-inf")
    conf, pred = logits.softmax(-1).max(-1)
    return conf[start:end], pred[start:end]


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [3] * 9, [20]]
CONFIGS = [quality(block_size=4), speed(block_size=4, max_post_steps=6), DecodeConfig(method="threshold", threshold=0.3),
           DecodeConfig(method="low_confidence", steps_per_block=3), speed(block_size=4, editing_threshold=None),
           quality(block_size=8, max_post_steps=2)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.method}-{c.threshold}-{c.editing_threshold}-{c.block_size}")
@pytest.mark.parametrize("stop", [[], [EOS]])
def test_block_cache_gives_exactly_the_no_cache_tokens(cfg, stop):
    model = tiny_model(seed=1)
    kw = dict(gen_length=13, stop_token_ids=stop)
    cached = diffusion_generate(model, PROMPTS, cfg, **kw)
    full = diffusion_generate(model, PROMPTS, cfg, use_cache=False, **kw)
    assert [r.tokens for r in cached] == [r.tokens for r in full]
    assert [r.forwards for r in cached] == [r.forwards for r in full]
    assert all(MASK not in r.tokens[:r.num_tokens] for r in cached)


def test_batched_prompts_decode_as_each_alone():
    model = tiny_model(seed=2)
    cfg = speed(block_size=4, max_post_steps=4)
    together = diffusion_generate(model, PROMPTS, cfg, gen_length=10, stop_token_ids=[])
    alone = [diffusion_generate(model, [p], cfg, gen_length=10, stop_token_ids=[])[0] for p in PROMPTS]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.forwards for r in together] == [r.forwards for r in alone]


def replay(model, prompt, result, cfg):
    """Check every recorded step of a one-block decode against the rule, using reference (p, x̂).
    Returns (M2T steps, edit-only steps, edits seen)."""
    P, B = len(prompt), cfg.block_size
    before = [MASK] * cfg.gen_length
    m2t = post = edits = 0
    for step, after in enumerate(result.trajectory):
        after = after.tolist()
        conf, pred = reference_conf_pred(model, prompt + before, 0, P + cfg.gen_length)
        conf, pred = conf[P:], pred[P:]
        masked = [t == MASK for t in before]
        if any(masked):
            m2t += 1
            passed = [m and float(c) > cfg.threshold for m, c in zip(masked, conf)]
            if not any(passed):
                best = max((float(c), i) for i, (m, c) in enumerate(zip(masked, conf)) if m)[1]
                passed = [i == best for i in range(len(before))]
        else:
            post += 1
            passed = [False] * len(before)
        for i, (b, a) in enumerate(zip(before, after)):
            if passed[i]:
                assert a == int(pred[i])
            elif masked[i]:
                assert a == MASK
            else:
                should = cfg.editing_threshold is not None and int(pred[i]) != b and float(conf[i]) > cfg.editing_threshold
                assert a == (int(pred[i]) if should else b)
                edits += a != b
        if post:                                # an edit-only step: the block ends iff nothing changed
            last = step == len(result.trajectory) - 1
            assert last == (after == before or post == cfg.max_post_steps)
        before = after
    assert P + cfg.gen_length <= B, "replay assumes a single block"
    return m2t, post, edits


def test_speed_mode_edits_whenever_the_prediction_changes_and_counts_edit_steps():
    model = tiny_model(block_size=16, seed=3)
    prompt = [4, 5, 6, 7]
    cfg = speed(block_size=16, gen_length=10, record=True)
    r = diffusion_generate(model, [prompt], cfg, stop_token_ids=[])[0]
    m2t, post, edits = replay(model, prompt, r, cfg)
    assert edits > 0 and edits == r.edits
    assert post >= 1 and r.forwards == m2t + post == len(r.trajectory) and r.edit_only_forwards == post
    assert r.tpf == pytest.approx(r.num_tokens / (m2t + post))


def test_quality_mode_follows_the_rule_with_its_thresholds():
    model = tiny_model(block_size=16, seed=4, scale=1.0)
    prompt = [9, 8]
    cfg = quality(block_size=16, gen_length=12, record=True)
    r = diffusion_generate(model, [prompt], cfg, stop_token_ids=[])[0]
    m2t, post, _ = replay(model, prompt, r, cfg)
    assert r.forwards == m2t + post and r.edit_only_forwards == post >= 1


def test_editing_off_never_changes_a_decoded_token():
    model = tiny_model(block_size=4, seed=5)
    cfg = speed(block_size=4, editing_threshold=None, gen_length=12, record=True)
    results = diffusion_generate(model, PROMPTS, cfg, stop_token_ids=[])
    for r in results:
        assert r.edits == r.edit_only_forwards == 0 and r.forwards == len(r.trajectory)
        for a, b in zip(r.trajectory, r.trajectory[1:]):
            decoded = a != MASK
            assert torch.equal(a[decoded], b[decoded])
    with_edit = diffusion_generate(model, PROMPTS[:1], speed(block_size=4, gen_length=12), stop_token_ids=[])[0]
    assert with_edit.edits > 0 and with_edit.forwards > results[0].forwards


def test_the_prompt_is_never_edited_even_when_the_model_disagrees_with_it():
    model = tiny_model(block_size=8, seed=6)
    prompt = [1, 2, 3, 4, 5, 6]                      # prompt tail shares block 0 with the response
    conf, pred = reference_conf_pred(model, prompt + [MASK] * 2, 0, 8)
    assert (pred[:6] != torch.tensor(prompt)).any()  # editing would have changed it
    for cfg in (speed(block_size=8), quality(block_size=8, editing_threshold=0.0)):
        r = diffusion_generate(model, [prompt], cfg, gen_length=10, stop_token_ids=[])[0]
        assert r.sequence[:6] == prompt and len(r.sequence) == 16


def test_low_confidence_baseline_unmasks_k_highest_per_step():
    model = tiny_model(block_size=16, seed=7)
    prompt = [3, 4]
    cfg = DecodeConfig(method="low_confidence", steps_per_block=4, gen_length=10, record=True)
    r = diffusion_generate(model, [prompt], cfg, stop_token_ids=[])[0]
    assert transfer_counts(10, 4) == [3, 3, 2, 2] and transfer_counts(2, 4) == [1, 1]
    before = torch.full((10,), MASK)
    for after, k in zip(r.trajectory, transfer_counts(10, 4)):
        conf, pred = reference_conf_pred(model, prompt + before.tolist(), 2, 12)
        new = (before == MASK) & (after != MASK)
        assert int(new.sum()) == k
        still = (after == MASK)
        assert conf[new].min() >= conf[still].max() if still.any() else True
        assert torch.equal(after[new], pred[new])
        before = after
    assert r.forwards == 4 and r.edits == 0


def test_threshold_baseline_commits_top_plus_confident():
    model = tiny_model(block_size=16, seed=8, scale=1.0)
    prompt = [7]
    cfg = DecodeConfig(method="threshold", threshold=0.4, gen_length=12, record=True)
    r = diffusion_generate(model, [prompt], cfg, stop_token_ids=[])[0]
    before = torch.full((12,), MASK)
    for after in r.trajectory:
        conf, pred = reference_conf_pred(model, prompt + before.tolist(), 1, 13)
        masked = before == MASK
        expect = masked & (conf >= 0.4)
        expect[torch.where(masked, conf, torch.tensor(-1.0)).argmax()] = True
        assert torch.equal(after != MASK, (before != MASK) | expect)
        before = after
    assert r.forwards == len(r.trajectory) and r.num_tokens == 12


def test_stop_token_ends_decoding_after_its_block():
    model = tiny_model(seed=9)
    free = diffusion_generate(model, PROMPTS, quality(block_size=4), gen_length=16, stop_token_ids=[])
    for p, r in zip(PROMPTS, free):
        stop = r.tokens[1]                           # pretend the 2nd response token is the stop
        s = diffusion_generate(model, [p], quality(block_size=4), gen_length=16, stop_token_ids=[stop])[0]
        assert s.num_tokens == s.tokens.index(stop) and s.forwards <= r.forwards


def test_bad_inputs_are_rejected():
    dense = CausalLM(ModelConfig())
    with pytest.raises(ValueError, match="block-diffusion"):
        diffusion_generate(dense, [[1]])
    with pytest.raises(ValueError, match="method"):
        DecodeConfig(method="greedy")


def test_edit_only_steps_stop_at_the_first_step_that_changes_nothing():
    model = tiny_model(block_size=16, seed=4, scale=1.0)
    cfg = quality(block_size=16, gen_length=12, editing_threshold=1.0, record=True)
    r = diffusion_generate(model, [[9, 8]], cfg, stop_token_ids=[])[0]
    m2t, post, edits = replay(model, [9, 8], r, cfg)
    assert (post, edits) == (1, 0) and r.forwards == m2t + 1
    capped = diffusion_generate(model, [[9, 8]], quality(block_size=16, gen_length=12, editing_threshold=0.0,
                                                         max_post_steps=3), stop_token_ids=[])[0]
    assert capped.forwards <= m2t + 3 + 12
