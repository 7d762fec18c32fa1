"""oneDNN float32 GEMMs (``arbor/kernels/fp32_gemm.py``): forward and backward against float64 within the
summation error of any order, the size and dtype rules that keep PyTorch's path, and a MoE model's
training step on them."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from arbor.kernels import fp32_gemm
from arbor.models import CausalLM, ModelConfig, VarlenAttention

needs = pytest.mark.skipif(not fp32_gemm.active(torch.zeros(1)), reason="oneDNN float32 GEMMs are off here "
                           "(ARBOR_CPU_KERNELS=0 or a PyTorch without oneDNN)")


def within_summation_error(got, a, b, bias=None):
    """|got − (a·b + bias)| ≤ γ_{K+2} · (|a|·|b| + |bias|) + u·|exact|, from float64: K float32 products and
    their sums in any order (γ_n = n·u / (1 − n·u), u = 2^-24: Higham §3.1) and the output's rounding. A
    reduced-precision GEMM (bfloat16 inputs: 2^-9 relative) is far outside it."""
    k, u = a.shape[-1], 2.0 ** -24
    gamma = (k + 2) * u / (1 - (k + 2) * u)
    exact = a.double() @ b.double() + (0 if bias is None else bias.double())
    mag = a.double().abs() @ b.double().abs() + (0 if bias is None else bias.double().abs())
    return bool(((got.double() - exact).abs() <= gamma * mag + u * exact.abs()).all())


def onednn_calls(fn) -> int:
    with profile() as p:
        fn()
    return sum(e.count for e in p.key_averages() if e.key == "mkldnn::_linear_pointwise")


@needs
@pytest.mark.parametrize("rows,k,n", [(256, 512, 384), (40, 1024, 96), (700, 64, 640)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_and_backward_are_float32_gemms(rows, k, n, bias):
    """y, ∂x, ∂W, ∂b of ``linear`` on [2, rows/2, K] input, each within float32 summation error of the
    float64 products y = x Wᵀ + b, ∂x = ∂y W, ∂W = ∂yᵀ x, ∂b = Σ ∂y; and oneDNN ran all three GEMMs."""
    torch.manual_seed(0)
    x = torch.randn(2, rows // 2, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    b = torch.randn(n, requires_grad=True) if bias else None
    dy = torch.randn(2, rows // 2, n)

    def run():
        y = fp32_gemm.linear(x, w, b)
        y.backward(dy)
        return y

    assert onednn_calls(run) == 3
    x2, dy2 = x.detach().reshape(-1, k), dy.reshape(-1, n)
    y = fp32_gemm.linear(x, w, b).detach().reshape(-1, n)
    assert within_summation_error(y, x2, w.detach().t(), None if b is None else b.detach())
    assert within_summation_error(x.grad.reshape(-1, k), dy2, w.detach())
    assert within_summation_error(w.grad, dy2.t(), x2)
    if bias:
        assert within_summation_error(b.grad[:, None], dy2.t(), torch.ones(rows, 1))


def test_small_gemms_float64_and_bfloat16_keep_pytorchs_path():
    """Below ``MIN_MACS`` oneDNN's call overhead loses (module docstring); other dtypes are not ours."""
    w = torch.randn(384, 128)
    assert not fp32_gemm.serves(torch.zeros(8, 128), w, 8 * 128 * 384)
    assert onednn_calls(lambda: fp32_gemm.linear(torch.randn(8, 128), w)) == 0
    for dtype in (torch.float64, torch.bfloat16):
        x, wd = torch.randn(256, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
        assert not fp32_gemm.serves(x, wd, 256 * 512 * 512)
        assert torch.equal(fp32_gemm.linear(x, wd), F.linear(x, wd))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp32_gemm.linear(torch.randn(256, 512), torch.randn(512, 512)).dtype == torch.bfloat16


@needs
def test_mm_into_writes_any_dtype_and_transposed_operands():
    torch.manual_seed(1)
    a, b = torch.randn(300, 200), torch.randn(500, 300)
    out = torch.empty(200, 500)
    fp32_gemm.mm_into(out, a.t(), b.t())
    assert within_summation_error(out, a.t(), b.t())
    wide = torch.empty(200, 500, dtype=torch.float64)
    fp32_gemm.mm_into(wide, a.t(), b.t())
    assert torch.equal(wide, out.double())


def test_cpu_kernels_off_turns_the_onednn_path_off(monkeypatch):
    monkeypatch.setattr(fp32_gemm, "_available", None)
    monkeypatch.setenv("ARBOR_CPU_KERNELS", "0")
    assert not fp32_gemm.active(torch.zeros(1))
    monkeypatch.setattr(fp32_gemm, "_available", None)
    monkeypatch.setenv("ARBOR_CPU_KERNELS", "yes")
    with pytest.raises(ValueError, match="ARBOR_CPU_KERNELS='yes'"):
        fp32_gemm.active(torch.zeros(1))


@needs
def test_moe_training_step_on_onednn_matches_float64(monkeypatch):
    """A tiny MoE model's loss and gradients with the oneDNN GEMMs (the experts padded to ``PAD_ROWS``)
    against the same model in float64, relative to each gradient's largest entry: measured 2.8e-6 with oneDNN
    and 2.6e-6 with PyTorch's own GEMMs (MKL) on this model; the bound is 10× that, where GEMMs at bfloat16
    precision land near 1e-3."""
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    wide = CausalLM(cfg).double()
    wide.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (1024,))
    attn = VarlenAttention.from_lengths([512, 512])

    def grads(m, expert_ids=None):
        m.zero_grad(set_to_none=True)
        out = m(ids, attn, routed_experts=expert_ids, return_routing=True)
        F.cross_entropy(m.logits(out.hidden)[:-1].float(), ids[1:]).backward()
        return {n: p.grad for n, p in m.named_parameters()}, out

    fast, out = grads(model)
    assert onednn_calls(lambda: grads(model)) > 0
    exact, _ = grads(wide, out.routed_experts)          # the float32 run's routing, so both use the same experts
    worst = max(float((fast[n].double() - exact[n]).abs().max() / exact[n].abs().max().clamp_min(1e-30))
                for n in exact if exact[n].abs().max() > 0)
    assert worst < 3e-5
