"""The routed MoE kernel stays finite where the residual stream is large.

silu(g) = g / (1 + e^{−g}): for g < −88, e^{−g} overflows float32. The kernel is built with
``-ffast-math`` (finite math assumed), so an overflowing ``expf`` must never reach the division; a
policy trained far enough grows activations of ~1e5 and the bf16 engine then sampled from NaN
log-probs while a plain ``.to(bfloat16)`` copy stayed finite."""

import pytest
import torch

from arbor.kernels import cpu_moe
from arbor.models.moe import Experts, dispatch_experts


@pytest.mark.skipif(cpu_moe.load_kernel() is None, reason="the routed MoE kernel needs a C compiler and AVX-512 BF16")
@pytest.mark.parametrize("scale", [1e2, 1e4, 1e5])
def test_routed_kernel_is_finite_and_exact_at_large_activations(scale):
    """Gate pre-activations reach ±scale · ~0.16: silu saturates to 0 (negative) or g (positive).
    The kernel matches the float64 reference within bfloat16 rounding: its float32 sums of bf16
    products and two bf16 roundings (h, y) give a relative error ≤ ~2⁻⁷ per rounding; 2⁻⁴ of the
    output's scale leaves room for accumulation order and still catches a lost or NaN term."""
    torch.manual_seed(0)
    e_, d, i, t, k = 4, 64, 48, 16, 2
    experts = Experts(e_, d, i).bfloat16()
    x = (torch.randn(t, d) * scale).bfloat16()
    ids = torch.stack([torch.randperm(e_)[:k] for _ in range(t)])
    w = torch.rand(t, k)
    plain = Experts(e_, d, i)
    plain.load_state_dict(experts.state_dict())
    ref = dispatch_experts(x.double(), ids, w.bfloat16().double(), plain.double())
    packed = cpu_moe.pack_vnni(experts.gate_up_proj), cpu_moe.pack_vnni(experts.down_proj)
    got = cpu_moe.routed_experts(x, ids, w, *packed).double()
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() <= 2 ** -4 * ref.abs().max()
