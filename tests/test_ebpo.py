"""EBPO's block-ELBO estimator, ESPO and the mean-field baseline: ratio exactly 1 at θ = θ_old, the
vectorised [noisy ⊕ clean] forward equal to a loop over blocks and draws, gradients vs finite
differences in float64; EBPO's one sequence ratio (the sum of the block ELBOs, clipped once), ESPO's
per-token normalised ratio and its unbiased ELBO estimate."""

import itertools

import torch

from arbor.models import BlockDiffusionAttention, CausalLM, ModelConfig
from arbor.dllm.ebpo import (draw_espo_noise, draw_noise, ebpo_loss, elbo_blocks, elbo_blocks_loop, mean_field_logprobs,
                             unit_logprobs)
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


def elbo_by_hand(model, prompts, responses, noise, weight=None):
    """ELBO_b of ``arbor.dllm.ebpo``'s docstring written out: per draw n (EBPO: level t_n, weight 1 / (N t_n);
    else ``weight(n, L, masked count)``) and response block b, the clean tokens before b then block b with its
    masked response tokens set to [MASK]; the log p of the masked tokens of b, summed, times the weight.
    → per sample, the values of its response blocks in order."""
    B, out = model.config.block_size, []
    weight = weight or (lambda n, L, c: 1 / (len(noise.levels) * noise.levels[n]))
    for s, (x, y) in enumerate(zip(prompts, responses)):
        seq, P = list(x) + list(y), len(x)
        blocks = range(P // B, (len(seq) - 1) // B + 1)
        elbo = dict.fromkeys(blocks, 0.0)
        for n in range(len(noise.response_masks)):
            masked = {P + i for i in range(len(y)) if noise.response_masks[n][s][i]}
            w = weight(n, len(y), len(masked)) if masked else 0.0
            for b in blocks:
                end = min((b + 1) * B, len(seq))
                ids = [MASK if p in masked and p >= b * B else seq[p] for p in range(end)]
                logp = log_p_by_hand(model, ids)
                elbo[b] += sum(float(logp[p, seq[p]]) for p in masked if b * B <= p < end) * w
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


def test_ebpo_ratio_is_the_sum_of_block_elbos_clipped_once_per_sequence():
    """LLaDA2.1's EBPO: log ρ(y|x) = Σ_b [ELBO_b(θ) − ELBO_b(θ_old)], one clipped ratio per sequence. Every
    block moves by +0.15 (r_b = 1.16, inside 1 + ε_high = 1.28), so a 3-block sample's sequence moves by 0.45
    (ρ = 1.57): with A > 0 it is clipped and gets no gradient under EBPO, while the per-block variant
    (``ebpo_block``, clipping each r_b) still trains it. float64, the loss against the formula by hand."""
    model = tiny_model(dtype=torch.float64)
    prompts, responses, noise = batch()
    blocks, valid = elbo_blocks(model, prompts, responses, noise)
    seq, seq_valid = unit_logprobs(model, prompts, responses, noise, "ebpo")
    assert seq.shape == (4, 1) and bool(seq_valid.all()) and valid.sum(1).tolist() == [3, 2, 2, 2]
    torch.testing.assert_close(seq[:, 0], blocks.sum(1), rtol=0, atol=1e-12)
    adv, shift, cfg = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64), 0.15, LossConfig(dual_clip=0)
    lp = seq.detach().clone().requires_grad_()
    loss, _ = ebpo_loss(lp, lp.detach() - shift * valid.sum(1, keepdim=True).double(), seq_valid, adv, cfg)
    loss.backward()
    rho = torch.exp(shift * valid.sum(1).double())                                  # e^0.45, e^0.3, e^0.3, e^0.3
    want = -torch.minimum(rho * adv, rho.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv).mean()
    assert abs(float(loss.detach()) - float(want)) < 1e-12
    # only sample 1 (A < 0, ρ above the band: the min keeps the unclipped term) carries gradient
    torch.testing.assert_close(lp.grad[:, 0], torch.tensor([0.0, float(rho[1]) / 4, 0.0, 0.0], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    per_block, ok = unit_logprobs(model, prompts, responses, noise, "ebpo_block")
    assert torch.equal(per_block, blocks) and torch.equal(ok, valid)
    lb = per_block.detach().clone().requires_grad_()
    ebpo_loss(lb, lb.detach() - shift * valid.double(), valid, adv, cfg)[0].backward()
    assert bool((lb.grad[valid] != 0).all())                 # every block of every sample is inside the band
    # one block per response: the two estimators give the same ratio
    wide = tiny_model(block_size=32, dtype=torch.float64)
    with torch.no_grad():
        a, _ = unit_logprobs(wide, prompts, responses, noise, "ebpo")
        b, v = unit_logprobs(wide, prompts, responses, noise, "ebpo_block")
    assert v.sum(1).tolist() == [1, 1, 1, 1] and torch.equal(a, b)


def espo_weight(num_mc):
    """ESPO's weight of a draw with c of L tokens masked: (L+1)/c halved between the draw and its
    antithetic complement, averaged over ``num_mc`` draws (ML-GSAI/ESPO ``_get_elbo``, reduce_var)."""
    return lambda n, L, c: (L + 1) / (2 * num_mc * c)


def test_espo_ratio_is_the_per_token_normalised_sequence_elbo():
    """ESPO: the unit is ELBO(y|x) / L, the ELBO from ESPO's draws written out by hand (float64); the draws
    are stratified (8 samples of length 7: each draw masks 0…7 tokens once) and come with their complements."""
    model = tiny_model(dtype=torch.float64)
    prompts, responses, _ = batch()
    noise = draw_espo_noise([len(x) for x in prompts], [len(y) for y in responses], num_mc=2, seed=4)
    assert len(noise.response_masks) == 4 and noise.levels == []
    for n in (0, 2):
        assert all(torch.equal(a, ~b) for a, b in zip(noise.response_masks[n], noise.response_masks[n + 1]))
    with torch.no_grad():
        seq, valid = unit_logprobs(model, prompts, responses, noise, "espo")
        by_hand = elbo_by_hand(model, prompts, responses, noise, espo_weight(2))
    want = [sum(b) / len(y) for b, y in zip(by_hand, responses)]
    assert seq.shape == (4, 1) and bool(valid.all())
    torch.testing.assert_close(seq[:, 0], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-10)
    counts = draw_espo_noise([3] * 8, [7] * 8, num_mc=3, seed=1).response_masks
    for n in range(0, 6, 2):
        assert sorted(int(m.sum()) for m in counts[n]) == list(range(8))
        assert [int(m.sum()) for m in counts[n + 1]] == [7 - int(m.sum()) for m in counts[n]]


def test_espo_elbo_is_unbiased_for_the_masked_diffusion_bound():
    """The mean of ESPO's estimate over many draws equals LLaDA's bound Σ_{l=1..L} (1/l) E_{|M|=l}[Σ_{i∈M}
    log p(y_i | y with M masked)], enumerated over all 2^L − 1 masks (one block, L = 4). 480 copies of the
    sample, 1 draw + complement each: every count 0…4 appears 96 times, so only the subset choice is random;
    the bound is 4 standard errors (the copies' spread ÷ √480)."""
    model = tiny_model(block_size=8, dtype=torch.float64)
    x, y = [5, 9], [3, 7, 2, 0]
    with torch.no_grad():
        exact = 0.0
        for l in range(1, len(y) + 1):
            subsets = list(itertools.combinations(range(len(y)), l))
            for M in subsets:
                logp = log_p_by_hand(model, x + [MASK if i in M else t for i, t in enumerate(y)])
                exact += sum(float(logp[len(x) + i, y[i]]) for i in M) / (l * len(subsets))
        S = 480
        noise = draw_espo_noise([len(x)] * S, [len(y)] * S, num_mc=1, seed=0)
        est, _ = elbo_blocks(model, [x] * S, [y] * S, noise)
    est = est[:, 0]
    assert abs(float(est.mean()) - exact) < 4 * float(est.std()) / S ** 0.5
    assert float(est.std()) > 0
