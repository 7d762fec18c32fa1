"""The CPU fast paths of the engine: the C paged decode-attention kernel against gather + SDPA,
the routed MoE kernel against the float32 reference, and oneDNN-packed linears against plain ones
(also after ``update_weights``)."""

import pytest
import torch
import torch.nn.functional as F

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.kernels import cpu_attention, cpu_moe
from arbor.engine.cpu_linear import PackedExperts, PackedLinear, available as packing_available
from arbor.models.moe import Experts, dispatch_experts
from arbor.models import CausalLM, ModelConfig
from tests.conftest import TINY
from tests.float64_ref import assert_near_exact, assert_within_engine_noise, exact_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
needs_kernel = pytest.mark.skipif(cpu_attention.load_kernel() is None, reason="no C compiler to build the kernel")


def reference(q, kc, vc, tables, lens, bs, scale, dtype=torch.float64):
    """Attention (float64: exact; float32: PyTorch's own rounding) of each query over the slots its block table names."""
    outs = []
    for b, n in enumerate(lens.tolist()):
        slots = torch.tensor([tables[b, t // bs].item() * bs + t % bs for t in range(n)])
        k, v = kc[slots].to(dtype), vc[slots].to(dtype)                        # [n, Hkv, D]
        outs.append(F.scaled_dot_product_attention(q[b, :, None].to(dtype), k.transpose(0, 1), v.transpose(0, 1),
                                                   scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (2, 2, 8), (8, 1, 128), (4, 2, 128), (4, 4, 32), (4, 2, 32), (16, 2, 16)])
def test_kernel_matches_attention_over_the_block_table(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    bs, blocks, width = 16, 40, 5
    kc = torch.randn(blocks * bs, kv_heads, head_dim).to(dtype)
    vc = torch.randn(blocks * bs, kv_heads, head_dim).to(dtype)
    lens = torch.tensor([80, 77, 33, 16, 1, 17], dtype=torch.int32)        # full, ragged, one key
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads + 2, head_dim).to(dtype)[:, :heads]    # rows spaced apart, as the model's q
    scale = head_dim ** -0.5
    out = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens, bs, scale)
    ref = reference(q, kc, vc, tables, lens, bs, scale)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:   # within 10× the error of PyTorch's float32 attention (measured ≤ 1.8×)
        assert_near_exact(out, reference(q, kc, vc, tables, lens, bs, scale, torch.float32), ref)
    else:   # float32 math, one rounding at the output: half a bfloat16 step (2^-8 relative) + float32's error
        assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()


needs_prefill_kernel = pytest.mark.skipif(cpu_attention.load_prefill_kernel() is None,
                                          reason="the prefill kernel needs a C compiler and AVX-512")


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,bs", [(4, 2, 64, 16), (8, 1, 128, 32), (4, 4, 48, 16), (16, 8, 128, 16)])
def test_prefill_kernel_matches_causal_attention_over_the_block_table(dtype, heads, kv_heads, head_dim, bs):
    """Chunks after 0..100 cached tokens, of 1..70 queries (tiles of 16 full and ragged, a chunk
    ending mid key-group), rows spaced apart in q, decode rows before the chunks left untouched,
    1 and 2 threads: float32 within rounding of the float64 reference, bfloat16 within one step."""
    torch.manual_seed(0)
    blocks = 40
    kc = torch.randn(blocks * bs, kv_heads, head_dim).to(dtype)
    vc = torch.randn(blocks * bs, kv_heads, head_dim).to(dtype)
    chunks = [(5, 0), (16, 0), (37, 20), (1, 3), (70, 0), (33, 100)]      # (queries, context)
    width = max(-(-(n + c) // bs) for n, c in chunks)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in chunks]).to(torch.int32)
    first = 3                                                              # rows 0..2: decodes, not ours
    rows = [first + sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    meta = torch.tensor([rows, [n for n, _ in chunks], [c for _, c in chunks]], dtype=torch.int32)
    q = torch.randn(rows[-1] + chunks[-1][0], heads + 2, head_dim).to(dtype)[:, :heads]
    scale = head_dim ** -0.5
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = torch.full(q.shape, 7.0, dtype=dtype)
        cpu_attention.paged_prefill_attention(q, kc, vc, tables, meta, bs, scale, out=out)
        assert (out[:first] == 7).all()
        for (n, c), r0, table in zip(chunks, rows, tables):
            slots = torch.tensor([table[t // bs].item() * bs + t % bs for t in range(c + n)])
            mask = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
            ref = F.scaled_dot_product_attention(q[r0:r0 + n].double().transpose(0, 1), kc[slots].double().transpose(0, 1),
                                                 vc[slots].double().transpose(0, 1), attn_mask=mask, scale=scale,
                                                 enable_gqa=True).transpose(0, 1)
            got = out[r0:r0 + n].double()
            if dtype == torch.float32:   # within 10× the error of PyTorch's float32 attention (measured ≤ 2.3×)
                plain = F.scaled_dot_product_attention(q[r0:r0 + n].transpose(0, 1), kc[slots].transpose(0, 1),
                                                       vc[slots].transpose(0, 1), attn_mask=mask, scale=scale,
                                                       enable_gqa=True).transpose(0, 1)
                assert_near_exact(got, plain, ref)
            else:   # one rounding to bfloat16: half a step (2^-8 relative) + float32's error
                assert ((got - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()


FAMILIES = {   # no q/k norm (plain RoPE instead of the fused norm+RoPE op); biases in the fused GEMMs
    "qwen3": dict(),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "llama": dict(architecture="LlamaForCausalLM", attention_bias=True, mlp_bias=True, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
}


def tiny_model(family="qwen3", **changes):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**(TINY | FAMILIES[family] | changes))).eval()
    with torch.no_grad():   # CausalLM starts biases at zero
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(std=0.05)
    return model


def greedy(engine, prompts, n=10):
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


PROMPTS = [[1, 2, 3], list(range(5, 45)), list(range(60, 77)), [9] * 20]


@needs_kernel
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_decodes_the_same_with_and_without_the_kernels(dtype, family, monkeypatch):
    """Prompts prefilled whole and in chunks after cached context (max_num_batched_tokens 24); head_dim
    16 so that the prefill kernel serves too."""
    model = tiny_model(family, head_dim=16)
    cfg = EngineConfig(dtype=dtype, num_blocks=64, max_num_batched_tokens=24)
    with_kernel = greedy(LLMEngine(model, cfg), PROMPTS)
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        monkeypatch.setattr(cpu_attention, name, lambda *a, **k: calls.append(1))
    monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    monkeypatch.setattr(cpu_attention, "supports_prefill", lambda *a: False)
    without = greedy(LLMEngine(model, cfg), PROMPTS)
    assert not calls
    assert with_kernel[0] == without[0]
    assert_engine_noise(model.to(getattr(torch, dtype)), PROMPTS, with_kernel, without)   # the weights served


@pytest.mark.skipif(not packing_available(), reason="no oneDNN packed bfloat16 linear equal to F.linear here (built without oneDNN, or a CPU without native bfloat16)")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_bf16_linears_are_exact_and_follow_weight_updates(family):
    model = tiny_model(family)
    engine = LLMEngine(model, EngineConfig(dtype="bfloat16", num_blocks=64))
    m = engine.model
    linears = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    assert engine.num_packed == len(linears) > 0
    assert not any("packed" in k for k in m.state_dict())                     # names as before
    assert model.model.layers[0].self_attn.fused_qkv is None                  # the caller's model is untouched
    x = torch.randn(5, TINY["hidden_size"]).bfloat16()
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    for got, lin in zip(attn.fused_qkv(x) + mlp.fused_gate_up(x), [attn.q_proj, attn.k_proj, attn.v_proj,
                                                                  mlp.gate_proj, mlp.up_proj]):
        assert torch.equal(got, F.linear(x, lin.weight, lin.bias))            # fused GEMMs, split: exact
    assert isinstance(attn.o_proj, PackedLinear) and torch.equal(attn.o_proj(x), F.linear(x, attn.o_proj.weight,
                                                                                          attn.o_proj.bias))
    assert (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == model.config.projection_bias
    shared = LLMEngine(m, EngineConfig(dtype="bfloat16", num_blocks=64))     # not its own copy: left alone
    assert shared.num_packed == 0

    with torch.no_grad():                                                     # a training step's worth of change
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(model.state_dict())
    fresh = LLMEngine(model, EngineConfig(dtype="bfloat16", num_blocks=64))
    assert greedy(engine, PROMPTS) == greedy(fresh, PROMPTS)


@pytest.mark.skipif(not packing_available(), reason="no oneDNN packed bfloat16 linear equal to F.linear here (built without oneDNN, or a CPU without native bfloat16)")
@pytest.mark.parametrize("routed", [True, False], ids=["routed-kernel", "onednn"])
def test_packing_keeps_hybrid_moe_outputs(routed, monkeypatch):
    """Gated attention (q_proj twice as wide), Gated DeltaNet, MoE router and shared expert. Experts
    run by the routed C kernel (float32 sums, within bfloat16 rounding of the float32 reference), or
    without it by oneDNN: packed per-expert GEMMs bit-identical, or two dense GEMMs over every expert
    where the cost model (``step_costs``) picks them (another summation order). Either way the same
    greedy tokens as the plain path, log-probs within bfloat16 rounding; new weights reach the
    packed copies (tokens equal but at near-ties: the dense path's order flips one there)."""
    import copy
    from tests.test_model_attention import HYBRID
    if routed and cpu_moe.load_kernel() is None:
        pytest.skip("the routed MoE kernel needs a C compiler and AVX-512 BF16")
    if not routed:
        monkeypatch.setattr(cpu_moe, "supports", lambda *shape: False)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**HYBRID)).eval()
    packed = LLMEngine(model, EngineConfig(dtype="bfloat16", num_blocks=64))                 # its own copy
    plain = LLMEngine(copy.deepcopy(model).bfloat16(), EngineConfig(dtype="bfloat16", num_blocks=64))
    assert packed.num_packed > 0 and plain.num_packed == 0
    experts = [m for m in packed.model.modules() if isinstance(m, PackedExperts)]
    assert experts and all((m.routed is not None) == routed for m in experts)
    x = torch.randn(7, HYBRID["hidden_size"]).bfloat16()
    with torch.no_grad():
        e = experts[0]
        ids = torch.stack([torch.randperm(e.num_experts)[:2] for _ in range(7)])
        w = torch.rand(7, 2).bfloat16()
        pe = plain_experts(e)                                              # (one call: its init draws random numbers)
        exact = dispatch_experts(x.double(), ids, w.double(), copy.deepcopy(pe).double())
        bf16 = dispatch_experts(x, ids, w, pe)                             # the bfloat16 PyTorch path
        if not routed:
            rows = [x[:3], x[:0], x[3:], x[:1]] + [x[:0]] * (e.gate_up_proj.shape[0] - 4)
            assert torch.equal(e.grouped(rows), Experts.grouped(e, rows))
        assert_near_exact(e.serve(x, ids, w), bf16, exact)             # 10× bfloat16's own error (measured ≤ 1×)
    prompts = [[t % 64 for t in p] for p in PROMPTS]
    assert_same_tokens(greedy(packed, prompts), greedy(plain, prompts), copy.deepcopy(model).bfloat16(), prompts)
    with torch.no_grad():                                           # new weights reach the packed copies
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    packed.update_weights(model.state_dict())
    assert_same_tokens_but_near_ties(greedy(packed, prompts), greedy(LLMEngine(copy.deepcopy(model).bfloat16(),
                                                                 EngineConfig(dtype="bfloat16", num_blocks=64)), prompts),
                       copy.deepcopy(model).bfloat16(), prompts)


@pytest.mark.skipif(cpu_moe.load_kernel() is None, reason="the routed MoE kernel needs a C compiler and AVX-512 BF16")
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (7, 1), (16, 2), (45, 3)])
def test_routed_moe_kernel_matches_float32(tokens, top_k):
    """``cpu_moe.routed_experts`` = Σ_j w_j · E_{ids_j}(x) of the float32 reference (bfloat16 weights
    and inputs) within bfloat16 rounding, for row counts around its 8-row tiles, an expert with no
    token, several threads; a tile edge or a lost pair would be off by whole terms."""
    torch.manual_seed(tokens)
    e_, d, i = 6, 64, 48
    experts = Experts(e_, d, i).bfloat16()
    x = torch.randn(tokens, d).bfloat16()
    ids = torch.stack([torch.randperm(e_ - 1)[:top_k] for _ in range(tokens)])     # expert e_−1 never routed
    w = torch.rand(tokens, top_k)
    pe = plain_experts(experts)
    exact = dispatch_experts(x.double(), ids, w.double(), pe.double())
    plain = dispatch_experts(x, ids, w.bfloat16(), pe.bfloat16())               # the bfloat16 PyTorch path
    packed = cpu_moe.pack_vnni(experts.gate_up_proj), cpu_moe.pack_vnni(experts.down_proj)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got = cpu_moe.routed_experts(x, ids, w, *packed)
        assert_near_exact(got, plain, exact)       # 10× bfloat16's own error (measured ≤ 0.6×)
    with pytest.raises(ValueError, match="expert ids must lie in 0..5"):   # checked before any write
        cpu_moe.routed_experts(x, torch.full_like(ids, e_), w, *packed)


@pytest.mark.skipif(cpu_moe.load_kernel() is None, reason="the routed MoE kernel needs a C compiler and AVX-512 BF16")
@pytest.mark.parametrize("norm", [True, False])
def test_routed_kernel_routes_like_moe_route(norm):
    """The fused router (softmax, top-k, renormalised weights rounded to bf16) in the kernel: the same
    ids and probabilities as ``MoE.route``, and the outputs of routing in PyTorch and running the
    routed kernel (within bf16 rounding); replayed ids keep the PyTorch router."""
    from arbor.models.moe import MoE
    torch.manual_seed(0)
    cfg = ModelConfig(**(TINY | dict(architecture="Qwen3MoeForCausalLM", hidden_size=64, num_experts=6,
                                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm)))
    moe = MoE(cfg).bfloat16().eval()
    moe.experts.__class__ = PackedExperts
    moe.experts.top_k = 2
    moe.experts.repack(every_path=True)
    x = torch.randn(37, 64).bfloat16()
    with torch.no_grad():
        y, ids, probs = moe(x)
        ref_ids, ref_w, ref_probs = moe.route(x)
        assert torch.equal(ids, ref_ids)
        assert_near_exact(probs, ref_probs, moe.gate(x).double().softmax(-1))   # float32 softmax: 10× its error
        pe = plain_experts(moe.experts)
        exact = dispatch_experts(x.double(), ref_ids, ref_w.double(), pe.double())
        plain = dispatch_experts(x, ref_ids, ref_w, pe.bfloat16())                # the bfloat16 PyTorch path
        assert_near_exact(y, plain, exact)       # weights may differ in a last bit (C division): 10× bf16 error
        replayed = torch.flip(ref_ids, [1])
        assert torch.equal(moe(x, replayed)[1], replayed)


def plain_experts(packed):
    """An ``Experts`` with the packed module's parameters (the unpacked reference path)."""
    plain = Experts(packed.num_experts, packed.gate_up_proj.shape[2], packed.down_proj.shape[2])
    plain.load_state_dict(packed.state_dict())
    return plain.to(packed.gate_up_proj.dtype)


def assert_same_tokens(got, ref, model, prompts):
    """Greedy (tokens, log-probs) of two engines serving ``model``: the same tokens, log-probs within 10×
    ``ref``'s own error of the float64 log-probs."""
    assert got[0] == ref[0]
    assert_engine_noise(model, prompts, got, ref)


def assert_same_tokens_but_near_ties(got, ref, model, prompts, tie=0.1):
    """As ``assert_same_tokens`` for engines whose bfloat16 sums run in different orders: the greedy tokens
    are equal up to a first divergence, where the float64 model's two candidates lie within ``tie`` of each
    other in log-prob (bfloat16 moves these tiny models' logits by ≤ 0.05 each, measured in
    test_engine_greedy; two engines: ≤ 0.1); log-probs within engine noise over the common prefix."""
    import copy
    model64 = copy.deepcopy(model).double()
    cut = []
    for p, a, b in zip(prompts, got[0], ref[0]):
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        if j < len(b):
            gap = exact_logprobs(model64, p, b[:j + 1])[-1] - exact_logprobs(model64, p, b[:j] + [a[j]])[-1]
            assert abs(float(gap)) <= tie, f"token {j} after {len(p)} prompt tokens: {a[j]} vs {b[j]}, gap {float(gap):.3g}"
        cut.append(j)
    assert min(cut) > 0
    exact = [exact_logprobs(model64, p, t[:j]) for p, t, j in zip(prompts, ref[0], cut)]
    assert_within_engine_noise([g[:j] for g, j in zip(got[1], cut)], [r[:j] for r, j in zip(ref[1], cut)], exact)


def assert_engine_noise(model, prompts, got, ref):
    """Greedy (tokens, log-probs) ``got`` and ``ref`` of two engines serving ``model``'s weights (tokens equal):
    log-probs within 10× ``ref``'s own error of the log-probs under a float64 copy (tests/float64_ref.py)."""
    import copy
    model64 = copy.deepcopy(model).double()
    exact = [exact_logprobs(model64, p, t) for p, t in zip(prompts, ref[0])]
    assert_within_engine_noise(got[1], ref[1], exact)


@pytest.mark.skipif(not packing_available(torch.float32), reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("hybrid", [False, True, "llama"])
def test_packed_fp32_copy_decodes_like_the_plain_path(hybrid):
    """``share_weights=False, fp32_gemm="onednn"``: the engine's own float32 copy runs oneDNN's packed
    GEMMs (sums in another order than MKL's ``F.linear``): the same greedy tokens, log-probs within
    float32 rounding, and the caller's module untouched; ``exact`` packs nothing."""
    from tests.test_model_attention import HYBRID
    torch.manual_seed(0)
    model = tiny_model("llama") if hybrid == "llama" else CausalLM(ModelConfig(**(HYBRID if hybrid else TINY))).eval()
    prompts = [[t % 64 for t in p] for p in PROMPTS] if hybrid is True else PROMPTS
    packed = LLMEngine(model, EngineConfig(num_blocks=64, share_weights=False))
    exact = LLMEngine(model, EngineConfig(num_blocks=64, share_weights=False, fp32_gemm="exact"))
    shared = LLMEngine(model, EngineConfig(num_blocks=64))
    assert packed.num_packed > 0 and exact.num_packed == shared.num_packed == 0
    assert packed.model is not model and shared.model is model
    assert not any(isinstance(m, (PackedLinear, PackedExperts)) for m in model.modules())
    (toks, lps), (toks_ref, lps_ref) = greedy(packed, prompts, 24), greedy(shared, prompts, 24)
    assert toks == toks_ref == greedy(exact, prompts, 24)[0]
    assert_engine_noise(model, prompts, (toks, lps), (toks_ref, lps_ref))      # float32 rounding (measured ≤ 1.2×)


def test_engine_config_refuses_bad_weight_keys():
    with pytest.raises(ValueError, match="fp32_gemm must be 'onednn' or 'exact'"):
        EngineConfig(fp32_gemm="mkl").validate()
    with pytest.raises(ValueError, match="share_weights must be true or false"):
        EngineConfig(share_weights="no").validate()
