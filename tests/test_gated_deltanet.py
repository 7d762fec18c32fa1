"""Gated DeltaNet: chunk form = recurrent form, state handoff, varlen packing, gradients, HF equality.
The equalities run in float64 (the rule and its state follow the input dtype), so they hold to
float64 rounding on any CPU; the comparison with transformers is float32 against our float64."""
import pytest
import torch

from arbor.models.gated_deltanet import (
    GatedDeltaNet,
    LinearState,
    causal_conv1d,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

HIDDEN, HK, HV, DK, DV, K = 32, 2, 4, 8, 16, 4


def rule_inputs(B, T, H, dk, dv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    q, k = l2norm(rand(B, T, H, dk)), l2norm(rand(B, T, H, dk))
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, rand(B, T, H, dv), g, beta, rand(B, H, dk, dv)


def make_layer(chunk_size=4, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, K, eps=1e-6, chunk_size=chunk_size)
    randomise_(layer)
    return layer.to(dtype)


def randomise_(module):
    """Non-trivial weights: projections and conv O(1), norm weight ≈ 1, decay rates exp(A_log) ≈ 0.4."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "norm.weight":
                p.normal_(1.0, 0.1)
            elif name == "A_log":
                p.normal_(-1.0, 0.5)
            else:
                p.normal_(0.0, 0.3)


def random_state(N, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return LinearState(torch.randn(N, 2 * HK * DK + HV * DV, K - 1, generator=gen, dtype=torch.float64),
                       torch.randn(N, HV, DK, DV, generator=gen, dtype=torch.float64))


def cu(*lengths):
    return torch.tensor([0, *lengths]).cumsum(0)


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
@pytest.mark.parametrize("T", [1, 5, 17, 33])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent(chunk_size, T, with_state):
    q, k, v, g, beta, S0 = rule_inputs(2, T, 3, 8, 16, dtype=torch.float64)
    S0 = S0 if with_state else None
    out_r, S_r = recurrent_gated_delta_rule(q, k, v, g, beta, S0)
    out_c, S_c = chunk_gated_delta_rule(q, k, v, g, beta, S0, chunk_size=chunk_size)
    assert out_c.shape == (2, T, 3, 16) and S_c.shape == (2, 3, 8, 16) and S_c.dtype == torch.float64
    assert max_diff(out_c, out_r) <= 1e-10    # float64, outputs < 1: measured 3.9e-16
    assert max_diff(S_c, S_r) <= 1e-10        # float64, state ≲ 3: measured 1.1e-15
    assert chunk_gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float())[1].dtype == torch.float32


def test_chunk_rule_gradcheck():
    inputs = [t.requires_grad_() for t in rule_inputs(1, 5, 2, 3, 2, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *a: chunk_gated_delta_rule(*a, chunk_size=2), inputs)


@pytest.mark.parametrize("T", [2, 6])
def test_causal_conv1d_gradcheck(T):
    gen = torch.Generator().manual_seed(0)
    x, w, state = (torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True)
                   for s in [(2, 3, T), (3, K), (2, 3, K - 1)])
    assert torch.autograd.gradcheck(causal_conv1d, (x, w, state))


def test_causal_conv1d_state_and_lengths():
    gen = torch.Generator().manual_seed(0)
    x, w, state = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in [(2, 3, 5), (3, K), (2, 3, K - 1)])
    y, new = causal_conv1d(x, w, state)
    y1, s1 = causal_conv1d(x[..., :2], w, state)  # shorter than K-1: the new state keeps history
    y2, s2 = causal_conv1d(x[..., 2:], w, s1)
    assert torch.equal(s1, torch.cat([state[..., 2:], x[..., :2]], -1))
    assert max_diff(torch.cat([y1, y2], -1), y) <= 1e-12 and torch.equal(s2, new)   # float64, y ≲ 4: measured 2.8e-17
    _, s_len = causal_conv1d(x, w, state, lengths=torch.tensor([5, 2]))
    assert torch.equal(s_len[0], new[0]) and torch.equal(s_len[1], s1[1])


@pytest.mark.parametrize("split", [1, 2, 5, 8, 9, 10])
def test_prefix_then_suffix_equals_full(split):
    layer, T = make_layer(), 11
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y, state = layer(x, cu(T))
    y1, s1 = layer(x[:split], cu(split))
    y2, s2 = layer(x[split:], cu(T - split), s1)
    assert max_diff(torch.cat([y1, y2]), y) <= 1e-10      # float64, values ≲ 11: measured 5.3e-15 (state 1.8e-15)
    assert max_diff(s2.conv, state.conv) <= 1e-10 and max_diff(s2.recurrent, state.recurrent) <= 1e-10


def test_decode_steps_equal_full():
    """Prefill two prompts, then decode one token per step; sequence 0 finishes before sequence 1."""
    layer, lengths, prompt = make_layer(), [9, 6], [5, 2]
    xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
          for i, n in enumerate(lengths)]
    y_full, s_full = layer(torch.cat(xs), cu(*lengths), random_state(2))
    y, state = layer(torch.cat([x[:p] for x, p in zip(xs, prompt)]), cu(*prompt), random_state(2))
    ys = [[y_i] for y_i in y.split(prompt)]
    for t in range(max(n - p for n, p in zip(lengths, prompt))):
        live = [i for i in range(2) if prompt[i] + t < lengths[i]]
        step_x = torch.stack([xs[i][prompt[i] + t] for i in live])
        y, sub = layer(step_x, cu(*[1] * len(live)), LinearState(state.conv[live], state.recurrent[live]))
        for j, i in enumerate(live):
            ys[i].append(y[j:j + 1])
        state.conv[live], state.recurrent[live] = sub.conv, sub.recurrent
    assert max_diff(torch.cat([torch.cat(y_i) for y_i in ys]), y_full) <= 1e-10     # float64, values ≲ 13: measured 7.1e-15
    assert max_diff(state.conv, s_full.conv) <= 1e-10 and max_diff(state.recurrent, s_full.recurrent) <= 1e-10


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_varlen_equals_separate(with_state):
    layer, lengths = make_layer(), [7, 1, 12]
    x = torch.randn(sum(lengths), HIDDEN, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    state = random_state(3) if with_state else None
    y, packed = layer(x, cu(*lengths), state)
    for i, (xi, yi) in enumerate(zip(x.split(lengths), y.split(lengths))):
        si = None if state is None else LinearState(state.conv[i:i + 1], state.recurrent[i:i + 1])
        y_sep, s_sep = layer(xi, cu(len(xi)), si)
        assert max_diff(yi, y_sep) <= 1e-10                                  # float64, values ≲ 13: measured 4e-15
        assert max_diff(packed.conv[i:i + 1], s_sep.conv) <= 1e-10
        assert max_diff(packed.recurrent[i:i + 1], s_sep.recurrent) <= 1e-10


def test_gradient_reaches_initial_state():
    layer = make_layer()
    state = random_state(2)
    state.conv.requires_grad_(), state.recurrent.requires_grad_()
    y, _ = layer(torch.randn(6, HIDDEN, dtype=torch.float64), cu(4, 2), state)
    y.square().sum().backward()
    assert state.conv.grad.abs().sum() > 0 and state.recurrent.grad.abs().sum() > 0


def test_matches_transformers():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
        linear_value_head_dim=DV, linear_conv_kernel_dim=K, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, intermediate_size=64)
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    randomise_(hf)
    ours = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, K, eps=config.rms_norm_eps, chunk_size=4)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(1, 10, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y_hf = hf(x)
        y, _ = ours(x[0], cu(10))
        exact, _ = ours.double()(x[0].double(), cu(10))
    noise = max_diff(y, exact)       # our own float32 rounding of this layer (outputs ≲ 16): 5.4e-6 here
    assert y_hf.abs().mean() > 0.1
    assert max_diff(y_hf[0], exact) <= 10 * noise   # HF float32 vs our float64: measured 4.9e-6, bound 10× our noise


def test_bad_inputs_raise():
    layer = make_layer()
    x = torch.randn(5, HIDDEN)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to len"):
        layer(x, cu(2, 2))
    with pytest.raises(ValueError, match="at least one token"):
        layer(x, cu(5, 0))
    with pytest.raises(ValueError, match=r"x must be \[T, 32\]"):
        layer(torch.randn(5, 16), cu(5))
    with pytest.raises(ValueError, match="state.conv must have shape"):
        layer(x, cu(2, 3), random_state(3))
    bad = random_state(2)
    with pytest.raises(ValueError, match="state.recurrent must have shape"):
        layer(x, cu(2, 3), LinearState(bad.conv, bad.recurrent[:, :, :, :4]))
    q, k, v, g, beta, S0 = rule_inputs(1, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="beta must have shape"):
        chunk_gated_delta_rule(q, k, v, g, beta[:, :2], S0)
