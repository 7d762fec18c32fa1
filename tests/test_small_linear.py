"""The few-row linear kernel (``arbor/kernels/small_linear.c``) against a float64 reference, and the
engine's packed linears taking it for decode-sized steps only."""

import pytest
import torch
import torch.nn.functional as F

from arbor.engine import EngineConfig, LLMEngine
from arbor.engine import cpu_linear
from arbor.kernels import cpu_small_linear
from tests.test_engine_cpu_kernels import PROMPTS, assert_engine_noise, greedy, tiny_model

needs = lambda dtype: pytest.mark.skipif(not cpu_small_linear.supports(dtype),
                                         reason=f"the few-row kernel needs AVX-512{' BF16' if dtype == torch.bfloat16 else ''}")


def error_bound(x, w, bias, dtype):
    """|fast − exact| allowed per output: float32 sums of K products (bf16 × bf16 products are exact in
    float32) accumulate at most γ_K · Σ_k |x_k w_k| (γ_K = K·u / (1 − K·u), u = 2^-24: the worst case of
    recursive summation, Higham §4.2) plus the bias's own rounding; bfloat16 output rounds once more, at
    most half a bfloat16 step (2^-8 relative)."""
    k, u = x.shape[-1], 2.0 ** -24
    gamma = k * u / (1 - k * u)
    mag = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    out_round = 2.0 ** -8 if dtype == torch.bfloat16 else u
    return exact, gamma * mag * (1 + out_round) + out_round * exact.abs() + 1e-30


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=needs(torch.float32)),
                                   pytest.param(torch.bfloat16, marks=needs(torch.bfloat16))])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 30), (96, 128), (1040, 3072)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_within_summation_error(dtype, n, k, threads):
    """Row counts across tiles of 16 (1, a partial tile, full tiles, 61, 64 = the engine's limit, 80 beyond it:
    the kernel itself takes any count), with and without bias, rows spaced apart in memory."""
    torch.manual_seed(0)
    w = torch.randn(n, k).to(dtype)
    packed = cpu_small_linear.pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 7, 16, 33, 61, 64, 80):
            x = torch.randn(m, k + 3).to(dtype)[:, 1:k + 1]
            for bias in (None, torch.randn(n).to(dtype)):
                got = cpu_small_linear.linear(x, packed, bias)
                exact, bound = error_bound(x, w, bias, dtype)
                assert got.dtype == dtype and got.shape == (m, n)
                assert ((got.double() - exact).abs() <= bound).all(), (m, bias is None)
    finally:
        torch.set_num_threads(before)


@needs(torch.float32)
def test_leading_dims_and_packability():
    w = torch.randn(32, 8)
    x = torch.randn(2, 3, 8)
    got = cpu_small_linear.linear(x, cpu_small_linear.pack(w))
    exact, bound = error_bound(x.reshape(6, 8), w, None, torch.float32)
    assert got.shape == (2, 3, 32) and ((got.reshape(6, 32).double() - exact).abs() <= bound).all()
    assert cpu_small_linear.packable(w) and not cpu_small_linear.packable(torch.randn(40, 8))   # N % 16
    assert not cpu_small_linear.packable(torch.randn(32, 7).bfloat16())                          # K odd in bf16


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=needs(torch.float32)),
                                   pytest.param("bfloat16", marks=needs(torch.bfloat16))])
def test_engine_decode_steps_take_the_kernel_and_decode_like_the_plain_path(dtype, monkeypatch):
    """An engine's own copy: decode steps (≤ MAX_ROWS rows) go through the kernel, prefill steps of more
    rows through oneDNN; greedy tokens equal an engine without the kernel, log-probs within engine noise."""
    if not cpu_linear.available(getattr(torch, dtype)) or not cpu_linear.small_linear_serves(getattr(torch, dtype)):
        pytest.skip("no packed linears, or the kernel does not serve this dtype on this CPU")
    model = tiny_model("llama")     # biases in every fused GEMM
    cfg = EngineConfig(dtype=dtype, num_blocks=64, share_weights=False)
    rows = []
    real = cpu_small_linear.linear
    monkeypatch.setattr(cpu_small_linear, "linear", lambda x, *a: rows.append(x.numel() // x.shape[-1]) or real(x, *a))
    prompts = PROMPTS + [list(range(1, 61))]        # a prefill step of more than MAX_ROWS rows
    eng = LLMEngine(model, cfg)
    eng.runner.decode_stack = None      # the module path, whose linears are counted (decode_stack: one C call)
    with_kernel = greedy(eng, prompts)
    assert rows and max(rows) <= cpu_small_linear.MAX_ROWS
    assert len(rows) >= 9 * 6        # 9 decode steps × (qkv, o, gate_up, down per layer …, lm_head)
    rows.clear()
    off = LLMEngine(model, EngineConfig(dtype=dtype, num_blocks=64, share_weights=False, few_row_kernel=False))
    without = greedy(off, prompts)
    assert not rows and off.num_packed > 0      # still packed (oneDNN), no few-row copy
    assert all(getattr(m, "small_weight", None) is None for m in off.model.modules())
    assert with_kernel[0] == without[0]
    assert_engine_noise(model.to(getattr(torch, dtype)), prompts, with_kernel, without)


def test_few_row_kernel_key_is_validated():
    with pytest.raises(ValueError, match="few_row_kernel must be true or false"):
        EngineConfig(few_row_kernel="yes").validate()
