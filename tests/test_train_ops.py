"""The trainer's fused ops (``arbor/kernels/train_ops.py``): bfloat16 forwards equal PyTorch's bfloat16
expressions and backwards are within PyTorch's own bfloat16 error of float64; float32 ones are within
float32 rounding of float64; the models take them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from arbor.kernels import train_ops
from arbor.models import CausalLM, ModelConfig, VarlenAttention
from arbor.models.layers import Rotary, apply_rope, rms_norm
from arbor.models.moe import Experts, dispatch_experts

pytestmark = pytest.mark.skipif(not train_ops.available(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="train_ops not built here (ARBOR_CPU_KERNELS=0 or no C compiler)")


def grads(fn, inputs, g, dtype, base=torch.bfloat16):
    """fn on inputs (float64 tensors) rounded to ``base`` then cast to dtype → [out, ∂ each input] in float64."""
    xs = [x.to(base).to(dtype).requires_grad_() for x in inputs]
    out = fn(*xs)
    out.backward(g.to(base).to(dtype))
    return [out.double()] + [x.grad.double() for x in xs]


def check(fn_ours, fn_torch, inputs, g, dtype=torch.bfloat16):
    """bfloat16 — forward: equal to PyTorch's bfloat16 expression except where a float32 sum in another order
    rounds to the other neighbour (≤ 1e-4 of the elements). Backward: each gradient's error against float64 at
    most PyTorch's bfloat16 error plus half a bfloat16 step at the largest value (2⁻⁸·max: both round their
    final result to bfloat16; ours keeps float32 where PyTorch rounds in between, measured 0.4–1.0×).
    float32 — output and every gradient: error against float64 (same float32 inputs) at most twice PyTorch's
    float32 error plus 2⁻¹⁷·max (128 float32 units of the largest value: both take O(1) roundings per element
    and float32 sums of up to 1600 terms, each in its own order, whose rounding grows as √n ≈ 40 units;
    measured: outputs and input gradients 0.8–1.8× PyTorch's error, the norm weights' gradients (sums over
    every row) up to 4.1×, all within 6 units of the largest value; a wrong formula is off by ~2²³ units)."""
    exact = grads(fn_torch, inputs, g, torch.float64, dtype)
    ours = grads(fn_ours, inputs, g, dtype, dtype)
    theirs = grads(fn_torch, inputs, g, dtype, dtype)
    if dtype == torch.float32:
        for a, b, e in zip(ours, theirs, exact):
            assert (a - e).abs().max() <= 2 * (b - e).abs().max() + 2 ** -17 * e.abs().max()
        return
    assert (ours[0] != theirs[0]).double().mean() <= 1e-4
    for a, b, e in zip(ours[1:], theirs[1:], exact[1:]):
        assert (a - e).abs().max() <= (b - e).abs().max() + 2 ** -8 * e.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_the_pytorch_expression(dtype):
    torch.manual_seed(0)
    x, w, g = torch.randn(300, 256, dtype=torch.float64) * 3, 1 + 0.1 * torch.randn(256, dtype=torch.float64), \
        torch.randn(300, 256, dtype=torch.float64)

    def expression(x, w):
        return w * F.rms_norm(x.float() if x.dtype == torch.bfloat16 else x, x.shape[-1:], None, 1e-6).to(x.dtype)
    check(lambda x, w: train_ops.rms_norm(x, w, 1e-6), expression, [x, w], g, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_qk_norm_rope_matches_norm_then_rope(rotary_dim, dtype):
    """GQA heads (6 query, 2 key-value) of 64 channels, whole and partial rotary."""
    torch.manual_seed(1)
    t, hq, hk, d = 200, 6, 2, 64
    cos, sin = Rotary(rotary_dim, 10000.0)(torch.arange(t) % 97, dtype)
    q, k = torch.randn(t, hq, d, dtype=torch.float64) * 2, torch.randn(t, hk, d, dtype=torch.float64)
    wq, wk = (1 + 0.1 * torch.randn(d, dtype=torch.float64) for _ in range(2))
    g = torch.randn(t, hq + hk, d, dtype=torch.float64)

    def expression(q, k, wq, wk):
        weight = torch.cat((wq.expand(hq, d), wk.expand(hk, d)))
        return apply_rope(rms_norm(torch.cat((q, k), 1), weight, 1e-6), cos.to(q.dtype), sin.to(q.dtype))
    check(lambda q, k, wq, wk: train_ops.qk_norm_rope(q, k, wq, wk, cos.to(q.dtype), sin.to(q.dtype), 1e-6),
          expression, [q, k, wq, wk], g, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [True, False])
def test_swiglu_matches_silu_times_up(weighted, dtype):
    torch.manual_seed(2)
    rows, inter = 257, 96
    h, c, g = torch.randn(rows, 2 * inter, dtype=torch.float64) * 2, torch.rand(rows, dtype=torch.float64), \
        torch.randn(rows, inter, dtype=torch.float64)

    def expression(h, c):
        act = F.silu(h[:, :inter]) * h[:, inter:]
        return act * c[:, None] if weighted else act + 0 * c[:, None]

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, c):
            ctx.save_for_backward(h, c)
            return train_ops.swiglu(h, c if weighted else None)

        @staticmethod
        def backward(ctx, da):
            h, c = ctx.saved_tensors
            dh, dc, out = train_ops.swiglu_backward(h, c if weighted else None, da.contiguous(), weighted, True)
            assert torch.equal(out, train_ops.swiglu(h, c if weighted else None))   # the forward, bit for bit
            return dh, dc.to(c.dtype) if weighted else torch.zeros_like(c)
    check(Fused.apply, expression, [h, c], g, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("moe", [False, True])
def test_training_steps_take_the_fused_ops(moe, dtype):
    """A bf16 or float32 CPU fwd + bwd runs the fused norm, q/k-norm + RoPE (and, with experts, SwiGLU)
    kernels; inference mode (the engine) does not."""
    cfg = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=96,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if moe:
        cfg |= dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf(cfg)).to(dtype)
    ids = torch.randint(0, 64, (40,))
    attn = VarlenAttention.from_lengths([40])
    with profile() as p:
        model.logits(model(ids, attn).hidden).float().sum().backward()
    names = {e.key for e in p.key_averages()}
    wanted = {"arbor::rms_norm_fwd", "arbor::rms_norm_bwd", "arbor::qk_norm_rope_fwd", "arbor::qk_norm_rope_bwd"}
    assert wanted | ({"arbor::swiglu_fwd", "arbor::swiglu_bwd"} if moe else set()) <= names
    with torch.inference_mode(), profile() as p:
        model(ids, attn)
    assert not any(e.key.startswith("arbor::qk_norm_rope") for e in p.key_averages())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_dispatch_sums_each_tokens_copies_in_float32(monkeypatch, dtype):
    """A bf16 or float32 MoE layer's experts, fwd + bwd (copies gathered and summed per token by ``sum_rows``,
    SwiGLU fused): output and every gradient within the error of the same layer on PyTorch's ops (index_add_,
    silu, ...) against float64, with ``check``'s allowance for the dtype (bf16: plus half a bfloat16 step at
    the largest value; float32: twice it plus 2⁻¹⁷ of the largest value)."""
    torch.manual_seed(3)
    experts = Experts(8, 64, 32)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x, ids, w, g = torch.randn(37, 64), torch.randint(0, 8, (37, 2)), torch.rand(37, 2), torch.randn(37, 64)

    real = train_ops.available

    def run(dtype, fused=True):
        monkeypatch.setattr(train_ops, "available", real if fused else lambda *t: False)
        ex = copy.deepcopy(experts).to(dtype)
        xs, ws = x.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()   # fresh leaves
        out = dispatch_experts(xs, ids, ws, ex, pad=None if dtype != torch.float64 else 1)
        out.backward(g.to(dtype))
        return [t.double() for t in (out, xs.grad, ws.grad, ex.gate_up_proj.grad, ex.down_proj.grad)]
    exact, theirs, ours = run(torch.float64), run(dtype, fused=False), run(dtype)
    factor, units = (1, 2 ** -8) if dtype == torch.bfloat16 else (2, 2 ** -17)
    for a, b, e in zip(ours, theirs, exact):
        assert (a - e).abs().max() <= factor * (b - e).abs().max() + units * e.abs().max()
