"""The trainer's MoE path (``RoutedRows`` under ``dispatch_experts``): forward and every gradient equal
a plain reference in float64, at two routed sparsities, with experts that receive no tokens, with and
without the padding bfloat16 uses (float64: only the order of sums differs; bounds of 1e-13 on values
≲ 1 allow summation-order round-off of ~100 ulps and nothing else)."""

import types

import pytest
import torch
import torch.nn.functional as F

from arbor.models.moe import MoE, Experts, dispatch_experts

SPARSITY = [(16, 2), (32, 8)]        # (experts, top-k): 1/8 and 1/4 of the experts per token


def plain_experts(x, ids, w, experts):
    """Σ_j w_j · E_{ids_j}(x) with one F.linear pair per (token, slot): the definition, no grouping."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    out = []
    for t in range(x.shape[0]):
        y = 0
        for j in range(ids.shape[1]):
            g, u = F.linear(x[t], gate_up[ids[t, j]]).chunk(2)
            y = y + w[t, j] * F.linear(F.silu(g) * u, down[ids[t, j]])
        out.append(y)
    return torch.stack(out)


def grads(fn, x, w, experts, dy):
    for p in (x, w, experts.gate_up_proj, experts.down_proj):
        p.grad = None
    y = fn()
    y.backward(dy)
    return [y.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


@pytest.mark.parametrize("num_experts,k", SPARSITY)
@pytest.mark.parametrize("pad", [None, 1, 8])
def test_dispatch_and_gradients_equal_plain_loop(num_experts, k, pad):
    torch.manual_seed(0)
    experts = Experts(num_experts, 24, 12).double()
    x = torch.randn(19, 24, dtype=torch.float64, requires_grad=True)
    used = torch.randperm(num_experts)[:num_experts // 2 + k]              # the other experts get no token
    ids = used[torch.rand(19, len(used)).argsort(-1)[:, :k]]
    w = torch.rand(19, k, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(19, 24, dtype=torch.float64)
    got = grads(lambda: dispatch_experts(x, ids, w, experts, pad=pad), x, w, experts, dy)
    ref = grads(lambda: plain_experts(x, ids, w, experts), x, w, experts, dy)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-13)
    idle = torch.ones(num_experts, dtype=torch.bool)
    idle[used] = False
    assert got[3][idle].eq(0).all() and got[4][idle].eq(0).all()          # exact zeros, not stale memory


@pytest.mark.parametrize("num_experts,k", SPARSITY)
def test_moe_layer_equals_transformers_experts(num_experts, k):
    """Router (softmax, top-k, renormalised) + experts, against the router's definition in float64 and
    transformers' Qwen3MoeExperts (eager) on the same weights: output and the gradients of input,
    router and experts. (transformers' own router takes its softmax in float32 whatever the input, so
    the definition stands in for it here.)"""
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    cfg = tf.Qwen3MoeConfig(hidden_size=32, num_experts=num_experts, num_experts_per_tok=k, moe_intermediate_size=16)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3MoeExperts(cfg).double()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    arbor = MoE(types.SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=True, hidden_size=32,
                                      num_experts=num_experts, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=0)).double()
    router = arbor.gate.weight.detach().clone().requires_grad_()
    arbor.experts.gate_up_proj.data.copy_(hf.gate_up_proj)
    arbor.experts.down_proj.data.copy_(hf.down_proj)
    x, dy = torch.randn(23, 32, dtype=torch.float64), torch.randn(23, 32, dtype=torch.float64)
    xa, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = arbor(xa)[0]
    ya.backward(dy)
    w, ids = F.softmax(xh @ router.t(), dim=-1).topk(k, dim=-1)
    yh = hf(xh, ids, w / w.sum(-1, keepdim=True))
    yh.backward(dy)
    pairs = [(ya, yh), (xa.grad, xh.grad), (arbor.gate.weight.grad, router.grad),
             (arbor.experts.gate_up_proj.grad, hf.gate_up_proj.grad), (arbor.experts.down_proj.grad, hf.down_proj.grad)]
    for a, b in pairs:
        assert torch.allclose(a, b, rtol=0, atol=1e-13)
    assert router.grad.abs().max() > 1e-3                                    # the router is really trained


def test_padding_keeps_bfloat16_outputs():
    """bfloat16 on CPU pads each expert's rows (to reuse oneDNN kernels): the padded copies carry weight
    0, so the result equals the float64 definition to bfloat16 round-off (measured ≤ 1.3e-2 of the
    largest output over seeds 0–2, padded or not; bound 3e-2), and no padded copy of token 0 adds to it."""
    torch.manual_seed(0)
    experts = Experts(8, 64, 32)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x, ids, w = torch.randn(37, 64), torch.randint(0, 8, (37, 2)), torch.rand(37, 2)
    exact = plain_experts(x.double(), ids, w.double(), experts.double())
    got = dispatch_experts(x.bfloat16(), ids, w.bfloat16(), experts.bfloat16(), pad=32)
    assert (got.double() - exact).abs().max() < 3e-2 * exact.abs().max()


def test_cpu_autocast_runs_the_experts_in_bfloat16_with_float32_gradients():
    """Under CPU bf16 autocast (``dtype=bfloat16`` training, float32 master weights) the experts run as autocast
    runs a linear: input, weights and routing weights cast to bf16. The output is the bf16 layer on the cast
    values, bit for bit; the float32 parameters get float32 gradients equal to the bf16 layer's, cast."""
    torch.manual_seed(4)
    experts = Experts(8, 64, 32)
    x, ids, w, dy = torch.randn(37, 64), torch.randint(0, 8, (37, 2)), torch.rand(37, 2), torch.randn(37, 64)
    half = Experts(8, 64, 32)
    half.load_state_dict(experts.state_dict())
    half = half.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dispatch_experts(x, ids, w, experts)
    want = dispatch_experts(x.bfloat16(), ids, w.bfloat16(), half)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got.backward(dy.bfloat16())
    want.backward(dy.bfloat16())
    for p, q in ((experts.gate_up_proj, half.gate_up_proj), (experts.down_proj, half.down_proj)):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad.float())


def test_expert_parallel_groups_take_autocasts_dtype_too():
    """``Experts.grouped`` (expert parallelism's local compute) under CPU bf16 autocast equals the bf16 experts."""
    torch.manual_seed(5)
    experts = Experts(4, 32, 16)
    half = Experts(4, 32, 16)
    half.load_state_dict(experts.state_dict())
    xs = [torch.randn(n, 32) for n in (3, 0, 5, 2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = experts.grouped(xs)
    assert got.dtype == torch.bfloat16 and torch.equal(got, half.bfloat16().grouped([x.bfloat16() for x in xs]))
