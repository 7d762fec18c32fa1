"""The fused CPU ops (RMSNorm, q/k-norm + RoPE, RoPE alone, SwiGLU's silu · mul) equal the PyTorch expressions
they replace, serve only inference-mode forwards (bfloat16, and float32 on a copy the engine owns),
and leave the engine's tokens unchanged."""

import copy

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.kernels import cpu_ops
from arbor.models import CausalLM, ModelConfig
from arbor.models.layers import Rotary, apply_rope, rms_norm
from tests.conftest import TINY
from tests.float64_ref import assert_near_exact, assert_within_engine_noise, exact_logprobs

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(cpu_ops._lib() is None, reason="no C compiler to build the ops")]
BF = torch.bfloat16


def assert_matches(got, ref, exact=None):
    """Equal but for rare one-step roundings (the float32 sum of squares in another order);
    float32: within 10× the PyTorch expression's own error of the float64 value ``exact``."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if got.dtype == torch.float32:
        assert_near_exact(got, ref, exact)      # measured ≤ 1.3× on AVX-512 and AVX2
        return
    assert (got == ref).float().mean() > 0.9999
    assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()   # one bf16 step


@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_rms_norm_matches_pytorch(dtype):
    torch.manual_seed(0)
    w = (torch.randn(128) * 0.3 + 1).to(dtype)
    x = (torch.randn(300, 3, 256) * 3).to(dtype)[:, 1, 64:192]       # strided rows
    with torch.inference_mode():
        got = cpu_ops.rms_norm(x, w, 1e-6)
    with torch.no_grad():                                             # the PyTorch path
        ref = rms_norm(x, w, 1e-6)
    assert_matches(got, ref, rms_norm(x.double(), w.double(), 1e-6))


def test_rotary_table_rows_equal_the_computed_tables():
    """The engine's own copy reads cos/sin rows from a table built by the same element-wise ops on the same
    float32 inputs (rows of 64: whole vectors, no scalar tail), so they are equal bit for bit; the table
    grows past its first 2048 positions; outside inference mode (the trainer) nothing is cached."""
    rotary = Rotary(64, 1e6)
    rotary.cached = True
    pos = torch.tensor([0, 5, 2047, 2048, 7000, 3])
    with torch.inference_mode():
        cos, sin = rotary(pos, torch.float32)
    ref = rotary.compute(pos, torch.float32)
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
    assert rotary._tables[torch.device("cpu"), torch.float32][0].shape[0] >= 7001
    rotary._tables.clear()
    rotary(pos, torch.float32)
    assert not rotary._tables


@pytest.mark.parametrize("dtype", [BF, torch.float32])
@pytest.mark.parametrize("rotary_dim", [64, 16])                     # full and partial (Qwen3-Next) rotary
def test_qk_norm_rope_matches_pytorch(rotary_dim, dtype):
    torch.manual_seed(1)
    T = 500
    qkv = torch.randn(T, 64 * 8).to(dtype)
    q, k = qkv[:, :256].view(T, 4, 64), qkv[:, 256:384].view(T, 2, 64)   # views of a fused projection
    wq, wk = [(torch.randn(64) * 0.3 + 1).to(dtype) for _ in range(2)]
    cos, sin = Rotary(rotary_dim, 1e6)(torch.randint(0, 4000, (T,)), dtype)
    with torch.inference_mode():
        got = cpu_ops.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-6)
    weight = torch.cat((wq.expand(4, 64), wk.expand(2, 64)))
    ref = apply_rope(rms_norm(torch.cat((q, k), 1), weight, 1e-6), cos, sin).split((4, 2), 1)
    exact = apply_rope(rms_norm(torch.cat((q, k), 1).double(), weight.double(), 1e-6), cos.double(),
                       sin.double()).split((4, 2), 1)                    # the same inputs, in float64
    for g, r, e in zip(got, ref, exact):
        assert_matches(g, r, e)


@pytest.mark.parametrize("dtype", [BF, torch.float32])
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_rope_matches_pytorch(rotary_dim, dtype):
    """RoPE alone (models without q/k norm): bfloat16 bit for bit (products and one sum, each rounded
    where PyTorch's ops round); float32 within 10× PyTorch's own error of the float64 value."""
    torch.manual_seed(2)
    T = 300
    qkv = torch.randn(T, 64 * 8).to(dtype)
    q, k = qkv[:, :256].view(T, 4, 64), qkv[:, 256:384].view(T, 2, 64)
    cos, sin = Rotary(rotary_dim, 1e4)(torch.randint(0, 4000, (T,)), dtype)
    with torch.inference_mode():
        got = cpu_ops.rope(q, k, cos, sin)
    ref = apply_rope(torch.cat((q, k), 1), cos, sin).split((4, 2), 1)
    exact = apply_rope(torch.cat((q, k), 1).double(), cos.double(), sin.double()).split((4, 2), 1)
    for g, r, e in zip(got, ref, exact):
        if dtype == BF:
            assert torch.equal(g, r)
        else:
            assert_matches(g, r, e)


@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_silu_mul_matches_pytorch(dtype):
    torch.manual_seed(2)
    gate, up = (torch.randn(300, 2 * 384) * 4).to(dtype).chunk(2, -1)   # halves of one fused GEMM: strided rows
    gate[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 200.0])            # beyond e^x's range: clamped, still exact
    with torch.inference_mode():
        got = cpu_ops.silu_mul(gate, up)
    assert_matches(got, torch.nn.functional.silu(gate) * up, torch.nn.functional.silu(gate.double()) * up.double())


def test_ops_serve_only_inference_mode_bf16_cpu(monkeypatch):
    calls = []
    real = cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    w = torch.ones(32, dtype=BF)
    with torch.no_grad():
        rms_norm(torch.randn(4, 32).to(BF), w, 1e-6)                  # the trainer's recompute
    with torch.inference_mode():
        rms_norm(torch.randn(4, 32), w.float(), 1e-6)                 # float32
    assert not calls
    with torch.inference_mode():
        rms_norm(torch.randn(4, 32).to(BF), w, 1e-6)
    assert calls == [1]
    x = torch.randn(4, 32)
    with torch.inference_mode():                                      # float32 only on an engine-owned copy
        assert not cpu_ops.use(x) and cpu_ops.use(x, owned=True)
        rms_norm(x, w.float(), 1e-6, engine_owned=True)
    assert calls == [1, 1]
    assert not cpu_ops.use(x, owned=True) and not cpu_ops.use(x.to(BF))   # never outside inference mode


def test_float32_fused_ops_only_on_the_engines_own_copy(monkeypatch):
    """A shared float32 model keeps the PyTorch ops (the trainer's log-probs bit for bit); the
    engine's own packed copy runs the fused ops with the same greedy tokens."""
    calls = []
    real_qk, real_sm, real_rms = cpu_ops.qk_norm_rope, cpu_ops.silu_mul, cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "qk_norm_rope", lambda *a: calls.append("qk") or real_qk(*a))
    monkeypatch.setattr(cpu_ops, "silu_mul", lambda *a: calls.append("sm") or real_sm(*a))
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda *a: calls.append("rms") or real_rms(*a))
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**TINY)).eval()
    prompts = [[1, 2, 3], list(range(5, 45)), [9] * 20]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    shared = LLMEngine(model, EngineConfig(num_blocks=64)).generate(prompts, params)
    assert not calls
    own = LLMEngine(model, EngineConfig(num_blocks=64, share_weights=False, fp32_gemm="onednn"))
    if not own.num_packed:
        pytest.skip("no oneDNN float32 packing here")
    fused = own.generate(prompts, params)
    assert "qk" in calls and "sm" in calls and "rms" in calls and own.model.rotary.cached
    assert [o.token_ids for o in fused] == [o.token_ids for o in shared]
    model64 = copy.deepcopy(model).double()                # log-probs: 10× float32 noise (measured ≤ 0.8×)
    assert_within_engine_noise([o.logprobs for o in fused], [o.logprobs for o in shared],
                               [exact_logprobs(model64, p, o.token_ids) for p, o in zip(prompts, shared)])


def test_bf16_engine_tokens_do_not_change(monkeypatch):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**TINY)).eval()
    prompts = [[1, 2, 3], list(range(5, 45)), [9] * 20]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cfg = EngineConfig(dtype="bfloat16", num_blocks=64)
    fused = LLMEngine(model, cfg).generate(prompts, params)
    monkeypatch.setattr(cpu_ops, "use", lambda x, owned=False: False)
    plain = LLMEngine(model, cfg).generate(prompts, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
    model64 = copy.deepcopy(model).bfloat16().double()     # the weights served; 10× bf16 noise (measured ≤ 1×)
    assert_within_engine_noise([o.logprobs for o in fused], [o.logprobs for o in plain],
                               [exact_logprobs(model64, p, o.token_ids) for p, o in zip(prompts, plain)])
