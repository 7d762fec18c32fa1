"""The engine's MoE step paths (``arbor.engine.cpu_linear.PackedExperts``): each path — the routed C
kernel, the grouped GEMMs over routed rows (oneDNN per expert in bfloat16, ``torch._grouped_mm`` in
float32), all experts densely — computes ``dispatch_experts`` within its dtype's rounding; the cost
model picks dense only where the routed-rows / total ratio k / E is high and the matrices tiny, the
routed kernel for decode-sized steps and the grouped GEMMs for prefill-sized ones at real sparsity;
and engines decode the same greedy tokens as the plain path at each bench MoE sparsity (32 experts
top-4, 64 top-8, the tiny 8 top-2), with the rule taking both sides within one run."""

import copy

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.engine.cpu_linear import AMX, PackedExperts, available as packing_available, step_costs
from arbor.kernels import cpu_moe
from arbor.models import CausalLM, ModelConfig
from arbor.models.moe import Experts, dispatch_experts
from tests.float64_ref import assert_near_exact

needs_onednn = pytest.mark.skipif(not packing_available(), reason="no oneDNN packed bfloat16 linear equal to F.linear here")


def test_cost_model_picks_by_sparsity_not_token_count():
    bf16, fp32 = torch.bfloat16, torch.float32

    def pick(t, k, e, d, i, dtype, routed, touched=None):
        costs = step_costs(t, k, e, d, i, touched or min(e, t * k), dtype, routed)
        return min(costs, key=costs.get)
    # (timed here, float32, 16 tokens: hidden 128 with 8 experts top-2 of 96 / 64 top-8 of 32, dense
    # 101 / 243 µs against grouped 130 / 448 µs; hidden 1024 with 32 top-4 of 512, dense 6.3 ms
    # against grouped 3.9 ms, and 3.5 against 0.6 ms for one token)
    assert pick(16, 2, 8, 128, 96, fp32, False) == pick(16, 8, 64, 128, 32, fp32, False) == "dense"
    # real sparsity (hidden 1024, 32 top-4 / 64 top-8): never dense in float32, even for one token
    for e, k, i in ((32, 4, 512), (64, 8, 256)):
        assert all(pick(t, k, e, 1024, i, fp32, False) == "grouped" for t in (1, 16, 64, 512))
        assert pick(16, k, e, 1024, i, bf16, True) == "routed"          # decode: weight streaming
        # prefill: with AMX, oneDNN's GEMMs; without, the routed kernel (AMD EPYC, AVX-512 BF16, moe64, 512
        # tokens: routed 9.7 ms, torch._grouped_mm 14.6 ms, oneDNN per expert 12.8 ms)
        assert pick(512, k, e, 1024, i, bf16, True) == ("grouped" if AMX else "routed")
    # the same token count and sparsity, another matrix size: the cost decides, not the count
    assert pick(16, 8, 64, 128, 32, fp32, False) == "dense" and pick(16, 8, 64, 1024, 256, fp32, False) == "grouped"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 40])
def test_every_path_computes_dispatch_experts(dtype, tokens):
    """Each path forced in turn = ``dispatch_experts`` over the plain ``Experts`` within 10× the plain
    path's own error of the float64 value (measured ≤ 2× for every path and dtype here)."""
    if not packing_available(dtype):
        pytest.skip(f"no oneDNN packed {dtype} linear equal to F.linear here (the engine packs nothing)")
    torch.manual_seed(tokens)
    e, d, i, k = 8, 64, 32, 3
    plain = Experts(e, d, i).to(dtype)
    packed = copy.deepcopy(plain)
    packed.__class__ = PackedExperts
    x = torch.randn(tokens, d).to(dtype)
    ids = torch.stack([torch.randperm(e - 1)[:k] for _ in range(tokens)])        # expert e−1 gets no token
    w = torch.rand(tokens, k).to(dtype)
    with torch.no_grad():
        packed.repack(every_path=True)
        exact = dispatch_experts(x.double(), ids, w.double(), copy.deepcopy(plain).double())
        ref = dispatch_experts(x, ids, w, plain)
        paths = {"dense": packed.dense}
        if packed.gmm_ok():
            paths["grouped_mm"] = packed.grouped_mm
        if packed.packed is not None:
            paths["onednn grouped"] = lambda *a: dispatch_experts(*a, _Grouped(packed))
        if packed.routed is not None:
            paths["routed"] = lambda x, ids, w: cpu_moe.routed_experts(x, ids, w, *packed.routed)
        assert len(paths) >= 2 + (dtype == torch.bfloat16 and cpu_moe.load_kernel() is not None)
        for name, fn in paths.items():
            assert_near_exact(fn(x, ids, w), ref, exact)
        assert_near_exact(packed.serve(x, ids, w) if packed.serve(x, ids, w) is not None
                          else dispatch_experts(x, ids, w, packed), ref, exact)


def _Grouped(m):
    """The packed module seen without its ``serve``: ``dispatch_experts`` then calls its ``grouped``."""
    class View:
        num_experts, grouped = m.num_experts, m.grouped
    return View()


def moe_model(num_experts, top_k, intermediate, seed=0):
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=96, hidden_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                                num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=intermediate,
                                norm_topk_prob=True, max_position_embeddings=1024)).eval()


@needs_onednn
@pytest.mark.parametrize("experts,dtype", [((4, 2, 128), "float32"), ((8, 2, 96), "float32"), ((32, 4, 64), "float32"),
                                          ((64, 8, 32), "float32"), ((4, 2, 128), "bfloat16")],
                         ids=["e4", "moe", "moe32", "moe64", "e4-bf16"])
def test_engine_decodes_like_the_plain_path_taking_both_sides(experts, dtype, monkeypatch):
    """Greedy tokens of an engine on its packed copy = the plain path's (float32: ``fp32_gemm='exact'``,
    nothing packed; bfloat16: the unpacked module), at the bench MoE sparsities scaled to hidden 128
    (and 4 experts top-2); a 300-token prompt's prefill and the decode steps take different paths
    (float32: grouped and dense). In bfloat16 at hidden 128 the routed kernel wins every step but, with AMX,
    the 4-expert prefill (dense; without the kernel dense wins every step); its float32 sums may flip a
    near-tie against the plain path's bfloat16 ones, so only that fixed case is compared
    (``test_engine_cpu_kernels`` bounds the log-probs)."""
    model = moe_model(*experts)
    taken = []
    path = PackedExperts.path
    monkeypatch.setattr(PackedExperts, "path", lambda self, *a: taken.append(path(self, *a)) or taken[-1])
    prompts = [[(7 * j + 3 * n) % 96 for j in range(n)] for n in (300, 5, 17)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    packed = LLMEngine(model, EngineConfig(dtype=dtype, num_blocks=96, share_weights=False))
    assert packed.num_packed > 0
    taken.clear()                                   # (packing asks which paths can win: not steps)
    got = [o.token_ids for o in packed.generate(prompts, params)]
    plain_cfg = dict(fp32_gemm="exact") if dtype == "float32" else {}
    source = model if dtype == "float32" else copy.deepcopy(model).bfloat16()
    plain = LLMEngine(source, EngineConfig(dtype=dtype, num_blocks=96, **plain_cfg))
    assert plain.num_packed == 0
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    if dtype == "float32" or (AMX and cpu_moe.load_kernel() is not None):   # bf16 without the kernel: dense
        assert len(set(taken)) == 2, taken                         # throughout; without AMX: routed throughout
    elif cpu_moe.load_kernel() is not None:
        assert set(taken) == {"routed"}, taken
