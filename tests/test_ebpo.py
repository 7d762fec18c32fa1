"""EBPO's block-ELBO estimator and the mean-field baseline: ratio exactly 1 at θ = θ_old, the
vectorised [noisy ⊕ clean] forward equal to a loop over blocks and levels, gradients vs finite
differences in float64."""

import torch

from arbor.models import BlockDiffusionAttention, CausalLM, ModelConfig
from arbor.dllm.ebpo import draw_noise, ebpo_loss, elbo_blocks, elbo_blocks_loop, mean_field_logprobs
from arbor.train.losses import LossConfig

MASK, EOS, V = 31, 0, 32


def tiny_model(block_size=4, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = ModelConfig(architecture="ArborBlockDiffusionForCausalLM", vocab_size=V, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, mask_token_id=MASK, block_size=block_size, eos_token_id=EOS)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(dtype)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [(3, 9), (5, 6), (8, 5), (2, 3)]       # prompt tails inside a block, block-aligned, several blocks
    prompts = [torch.randint(1, MASK, (p,), generator=g).tolist() for p, _ in lens]
    responses = [torch.randint(0, MASK, (r,), generator=g).tolist() for _, r in lens]
    noise = draw_noise([p for p, _ in lens], [r for _, r in lens], [0.25, 0.5, 0.75, 1.0], 0.3, seed=seed)
    return prompts, responses, noise


def log_p_by_hand(model, ids):
    """float64 log p over the vocabulary without the mask token, every position of one block-causal forward."""
    hidden = model(torch.tensor(ids), BlockDiffusionAttention.from_lengths([len(ids)], model.config.block_size)).hidden
    logits = model.logits(hidden).double()
    logits[:, MASK] = float("-inf")
    return logits.log_softmax(-1)


def elbo_by_hand(model, prompts, responses, noise):
    """ELBO_b of ``arbor.dllm.ebpo``'s docstring written out: per level t_n (weight 1 / (N t_n)) and response
    block b, the clean tokens before b then block b with its masked response tokens set to [MASK]; the
    log p of the masked tokens of b, summed. → per sample, the values of its response blocks in order."""
    B, N, out = model.config.block_size, len(noise.levels), []
    for s, (x, y) in enumerate(zip(prompts, responses)):
        seq, P = list(x) + list(y), len(x)
        blocks = range(P // B, (len(seq) - 1) // B + 1)
        elbo = dict.fromkeys(blocks, 0.0)
        for n, t in enumerate(noise.levels):
            masked = {P + i for i in range(len(y)) if noise.response_masks[n][s][i]}
            for b in blocks:
                end = min((b + 1) * B, len(seq))
                ids = [MASK if p in masked and p >= b * B else seq[p] for p in range(end)]
                logp = log_p_by_hand(model, ids)
                elbo[b] += sum(float(logp[p, seq[p]]) for p in masked if b * B <= p < end) / (N * t)
        out.append([elbo[b] for b in blocks])
    return out


def mean_field_by_hand(model, prompts, responses, noise):
    """d1's estimate written out: the prompt with its drawn tokens masked, the response all [MASK], one
    forward; log p(y_i) at each response position. → per sample, per response token."""
    out = []
    for s, (x, y) in enumerate(zip(prompts, responses)):
        ids = [MASK if noise.prompt_masks[s][i] else t for i, t in enumerate(x)] + [MASK] * len(y)
        logp = log_p_by_hand(model, ids)
        out.append([float(logp[len(x) + i, t]) for i, t in enumerate(y)])
    return out


def test_log_ratio_is_exactly_zero_at_theta_old():
    """float32 and float64: the same noise gives θ and θ_old bit-equal values; in float64 the values are the
    docstring's formulas computed by hand (≤ 1e-10: float64 sums of ~100 terms of size ≤ 10 round at ~1e-13)."""
    for dtype in (torch.float32, torch.float64):
        model = tiny_model(dtype=dtype)
        prompts, responses, noise = batch()
        for est, by_hand in ((elbo_blocks, elbo_by_hand), (mean_field_logprobs, mean_field_by_hand)):
            with torch.no_grad():
                old, _ = est(model, prompts, responses, noise)
            new, valid = est(model, prompts, responses, noise)
            assert torch.equal((new - old)[valid], torch.zeros_like(new[valid]))
            loss, stats = ebpo_loss(new, old, valid, torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=dtype), LossConfig())
            assert stats["approx_kl"] == 0.0 and stats["clip_low"] == 0.0 and stats["clip_high"] == 0.0
            if dtype == torch.float64:
                with torch.no_grad():
                    want = by_hand(model, prompts, responses, noise)
                assert valid.sum(1).tolist() == [len(w) for w in want]
                got = [old[i][valid[i]].tolist() for i in range(len(want))]
                for g, w in zip(got, want):
                    torch.testing.assert_close(torch.tensor(g, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                                               rtol=0, atol=1e-10)


def test_vectorised_elbo_equals_block_by_block_loop():
    model = tiny_model(dtype=torch.float64)
    prompts, responses, noise = batch(1)
    with torch.no_grad():
        fast, valid = elbo_blocks(model, prompts, responses, noise)
        slow, valid_loop = elbo_blocks_loop(model, prompts, responses, noise)
    assert torch.equal(valid, valid_loop)
    assert valid.sum(1).tolist() == [3, 2, 2, 2]
    torch.testing.assert_close(fast[valid], slow[valid], atol=1e-10, rtol=0)   # float64: two sum orders, ~1e-15 apart
    assert bool((fast[valid] < 0).all())        # every block has a masked token at t = 1


def test_gradient_matches_finite_differences_float64():
    model = tiny_model(dtype=torch.float64)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())   # untied from the embedding
    prompts, responses, noise = batch(2)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=torch.float64)
    with torch.no_grad():
        old, _ = elbo_blocks(model, prompts, responses, noise)
    w = model.lm_head.weight          # a float64 model: float64 all the way

    def loss_value():
        new, valid = elbo_blocks(model, prompts, responses, noise)
        return ebpo_loss(new, old - 0.05, valid, adv, LossConfig(clip_low=0.5, clip_high=0.5))[0]

    model.zero_grad()
    loss_value().backward()
    grad = w.grad.clone()
    h = 1e-5
    for idx in [(0, 0), (3, 5), (7, 11), (MASK - 1, 2)]:
        with torch.no_grad():
            w[idx] += h
            up = float(loss_value())
            w[idx] -= 2 * h
            down = float(loss_value())
            w[idx] += h
        # central difference in float64: truncation ~h²·|f'''| ≲ 1e-9, rounding ~1e-16·|f|/h ≲ 1e-10
        assert abs((up - down) / (2 * h) - float(grad[idx])) < 1e-7 + 1e-6 * abs(float(grad[idx]))
    assert float(grad.abs().max()) > 1e-3


def test_sampled_diffusion_rollouts_are_seeded():
    from arbor.dllm.decoding import DecodeConfig, diffusion_generate
    model = tiny_model(block_size=4)
    prompts = [[1, 2, 3], [4, 5]] * 3
    cfg = DecodeConfig(method="threshold", threshold=0.9, editing_threshold=None, gen_length=8)
    run = lambda **kw: [r.tokens for r in diffusion_generate(model, prompts, cfg, [EOS], **kw)]
    greedy = run()
    assert greedy[0] == greedy[2] and run(temperature=0.0, seed=5) == greedy
    a, b = run(temperature=1.0, seed=1), run(temperature=1.0, seed=2)
    assert a == run(temperature=1.0, seed=1) and a != b
    assert len({tuple(t) for t in a}) > 2          # the copies of one prompt differ
    assert all(MASK not in t for t in a)
