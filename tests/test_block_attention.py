"""Block attention (``arbor/models/block_attention.py``): output and gradients against float64 SDPA, and the
dispatch that sends CPU training attention to it."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from arbor.models import VarlenAttention
from arbor.models.attention import sdpa
from arbor.models.block_attention import block_attention


def reference(q, k, v, scale, mask=None, causal=False):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          is_causal=causal, scale=scale, enable_gqa=True).transpose(1, 2)


def outputs_and_grads(fn, q, k, v, g, dtype):
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*xs)
    out.backward(g.to(dtype))
    return [out.double()] + [x.grad.double() for x in xs]


CASES = [dict(b=2, t=300, hq=4, hkv=2, d=32, causal=True),        # GQA, a partial last block
         dict(b=1, t=200, hq=4, hkv=4, d=16, causal=False),       # a bool mask
         dict(b=1, t=256, hq=6, hkv=2, d=64, causal=True)]


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_sdpa_within_float32_noise(case):
    """float64 inputs: equal to SDPA to 1e-12. float32: each of out, ∂q, ∂k, ∂v within 4× PyTorch's own float32
    SDPA error on the same inputs (both against float64; measured ratios 0.6–2.0 at these shapes and at
    4 × 512 tokens, 8/4 heads of 128)."""
    torch.manual_seed(0)
    b, t, hq, hkv, d = (case[x] for x in ("b", "t", "hq", "hkv", "d"))
    q, k, v = torch.randn(b, t, hq, d, dtype=torch.float64), torch.randn(b, t, hkv, d, dtype=torch.float64), \
        torch.randn(b, t, hkv, d, dtype=torch.float64)
    g = torch.randn(b, t, hq, d, dtype=torch.float64)
    mask = None if case["causal"] else (torch.rand(t, t) < 0.3) | torch.eye(t, dtype=torch.bool)
    scale = d ** -0.5
    exact = outputs_and_grads(lambda *x: reference(*x, scale, mask, case["causal"]), q, k, v, g, torch.float64)
    ours64 = outputs_and_grads(lambda *x: block_attention(*x, scale, mask, case["causal"]), q, k, v, g, torch.float64)
    assert all((a - e).abs().max() < 1e-12 for a, e in zip(ours64, exact))
    ours = outputs_and_grads(lambda *x: block_attention(*x, scale, mask, case["causal"]), q, k, v, g, torch.float32)
    torch_own = outputs_and_grads(lambda *x: reference(*x, scale, mask, case["causal"]), q, k, v, g, torch.float32)
    for a, p, e in zip(ours, torch_own, exact):
        assert (a - e).abs().max() <= 4 * (p - e).abs().max()


def test_float32_takes_the_fused_softmax_steps():
    """Where ``train_ops`` is built, float32 block attention runs its softmax, exp(S − lse) and P ∘ (∂P − Δ)
    fused (the float64 comparison above then checks those kernels); float64 keeps PyTorch's expressions."""
    from arbor.kernels import train_ops
    if not train_ops.available(torch.zeros(1)):
        pytest.skip("train_ops not built here (ARBOR_CPU_KERNELS=0 or no compiler)")
    names = ("arbor::softmax_rows", "arbor::shifted_exp_rows", "arbor::softmax_grad_rows")

    def kernels(dtype):
        q, k, v = (torch.randn(1, 200, h, 16, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
        with profile() as p:
            block_attention(q, k, v, 0.25, causal=True).sum().backward()
        return {e.key: e.count for e in p.key_averages() if e.key in names}

    assert kernels(torch.float32) == dict.fromkeys(names, 2)            # two query blocks of 128
    assert kernels(torch.float64) == {}


@pytest.mark.parametrize("case", CASES + [dict(b=2, t=512, hq=8, hkv=4, d=128, causal=True)])
def test_bfloat16_within_three_times_the_flash_kernels_error(case):
    """bf16 q, k, v (bfloat16 GEMMs, shifts inside the backward's GEMMs): each of out, ∂q, ∂k, ∂v within 3×
    the error of PyTorch's bfloat16 SDPA (FlashAttention's roundings) on the same inputs, both against float64
    on the bf16 values. Derived, not tuned: an element of ∂S takes at most three bfloat16 roundings here (the
    shifted S, ∂P − Δ, ∂S itself) where FlashAttention takes one (∂S); measured ratios 0.4–2.1."""
    torch.manual_seed(2)
    b, t, hq, hkv, d = (case[x] for x in ("b", "t", "hq", "hkv", "d"))
    q, k, v = (torch.randn(b, t, h, d).bfloat16().double() for h in (hq, hkv, hkv))
    q = (3 * q).bfloat16().double()                 # sharper softmax rows than unit-variance logits
    g = torch.randn(b, t, hq, d).bfloat16().double()
    mask = None if case["causal"] else (torch.rand(t, t) < 0.3) | torch.eye(t, dtype=torch.bool)
    scale = d ** -0.5
    exact = outputs_and_grads(lambda *x: reference(*x, scale, mask, case["causal"]), q, k, v, g, torch.float64)
    ours = outputs_and_grads(lambda *x: block_attention(*x, scale, mask, case["causal"]), q, k, v, g, torch.bfloat16)
    flash = outputs_and_grads(lambda *x: reference(*x, scale, mask, case["causal"]), q, k, v, g, torch.bfloat16)
    for a, f, e in zip(ours, flash, exact):
        assert (a - e).abs().max() <= 3 * (f - e).abs().max()


def test_a_row_that_sees_no_key_gives_zero():
    q, k, v = torch.randn(1, 130, 2, 8), torch.randn(1, 130, 2, 8), torch.randn(1, 130, 2, 8)
    mask = torch.eye(130, dtype=torch.bool)
    mask[5] = False
    out = block_attention(q, k, v, 1.0, mask)
    assert torch.equal(out[0, 5], torch.zeros(2, 8)) and torch.allclose(out[0, 6], v[0, 6])


def test_training_attention_on_cpu_takes_block_attention_and_inference_mode_keeps_sdpa():
    attn = VarlenAttention.from_lengths([200, 150])
    q = torch.randn(350, 4, 128, requires_grad=True)
    k, v = torch.randn(350, 2, 128), torch.randn(350, 2, 128)

    def blocks(fn):
        with profile() as p:
            fn()
        return sum(e.count for e in p.key_averages() if e.key == "BlockAttention")

    assert blocks(lambda: attn.attend(0, q, k, v, 0.25).sum().backward()) == 2
    with torch.inference_mode():
        assert blocks(lambda: attn.attend(0, q, k, v, 0.25)) == 0
    assert blocks(lambda: sdpa(q[None, :64].double(), k[None, :64].double(), v[None, :64].double(), 0.25,
                               causal=True)) == 0          # float64 and short inputs keep PyTorch's kernel
    assert blocks(lambda: sdpa(q[None, :, :, :64], k[None, :, :, :64], v[None, :, :, :64], 0.25, causal=True)) == 0


def test_cpu_autocast_attends_in_autocasts_dtype():
    """Under CPU bf16 autocast (``dtype=bfloat16`` training) float32 q, k, v are cast to bf16 first, as autocast
    casts SDPA's inputs: the bf16 block attention runs and its output is bf16, equal to it on the cast inputs."""
    attn = VarlenAttention.from_lengths([200])
    q, k, v = torch.randn(200, 4, 128), torch.randn(200, 2, 128), torch.randn(200, 2, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16), profile() as p:
        out = attn.attend(0, q, k, v, 0.25)
    assert out.dtype == torch.bfloat16 and any(e.key == "Bf16BlockAttention" for e in p.key_averages())
    assert torch.equal(out, attn.attend(0, q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25))
