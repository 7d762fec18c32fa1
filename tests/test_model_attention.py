"""Packed, tree and block-diffusion attention compute what separate forwards compute."""

import pytest
import torch
import torch.nn.functional as F

from arbor.models import BlockDiffusionAttention, CausalLM, ModelConfig, TreeAttention, VarlenAttention
from arbor.models.attention import ancestor_mask, tree_depths

DENSE = dict(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
MOE = DENSE | dict(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
HYBRID = DENSE | dict(architecture="Qwen3NextForCausalLM", num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=16, partial_rotary_factor=0.25,
                      layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def model_of(cfg: dict, seed=0) -> CausalLM:
    """float64: the equalities below then hold to float64 rounding on any CPU."""
    torch.manual_seed(seed)
    return CausalLM(ModelConfig(**cfg)).double().eval()


def logits_of(model, ids, attn, positions=None):
    return model.logits(model(ids, attn, positions).hidden)


@pytest.mark.parametrize("cfg", [DENSE, MOE, HYBRID], ids=["dense", "moe", "hybrid"])
def test_packed_equals_separate(cfg):
    model = model_of(cfg)
    seqs = [torch.randint(0, 64, (n,)) for n in (5, 17, 1, 9)]
    with torch.no_grad():
        packed = logits_of(model, torch.cat(seqs), VarlenAttention.from_lengths([len(s) for s in seqs]))
        alone = torch.cat([logits_of(model, s, VarlenAttention.from_lengths([len(s)])) for s in seqs])
    assert (packed - alone).abs().max() <= 1e-10     # float64, logits < 1: measured 1.2e-16 (float32: 6e-8)


def test_ancestor_mask_and_depths():
    parents = torch.tensor([-1, 0, 1, 1, 3, -1, 5])
    mask = ancestor_mask(parents)
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert mask[6].nonzero().flatten().tolist() == [5, 6]
    assert tree_depths(parents).tolist() == [0, 1, 2, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="earlier tokens"):
        ancestor_mask(torch.tensor([1, -1]))


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_tree_equals_paths(cfg):
    model = model_of(cfg)
    # shared prefix of 6 tokens, two branches of 4 and 3, the first forks again after 2.
    parents, tokens = [], []

    def add(parent, n):
        idx = []
        for _ in range(n):
            parents.append(parent)
            tokens.append(int(torch.randint(0, 64, ())))
            parent = len(parents) - 1
            idx.append(parent)
        return idx

    torch.manual_seed(5)
    root = add(-1, 6)
    a = add(root[-1], 2)
    a1 = add(a[-1], 2)
    a2 = add(a[-1], 3)
    b = add(root[-1], 3)
    attn = TreeAttention(torch.tensor(parents))
    ids = torch.tensor(tokens)
    with torch.no_grad():
        tree = logits_of(model, ids, attn)
        for path in (root + a + a1, root + a + a2, root + b):
            alone = logits_of(model, ids[path], VarlenAttention.from_lengths([len(path)]))
            assert (tree[path] - alone).abs().max() <= 1e-10     # float64, logits < 1: measured 1.1e-16


def test_block_diffusion_visibility():
    cfg = DENSE | dict(architecture="ArborBlockDiffusionForCausalLM", block_size=4, mask_token_id=63)
    model = model_of(cfg)
    ids = torch.randint(0, 63, (12,))
    attn = BlockDiffusionAttention.from_lengths([12], block_size=4)
    with torch.no_grad():
        base = logits_of(model, ids, attn)
        for b in range(3):
            changed = ids.clone()
            changed[4 * b + 1] = 63  # one token of block b
            diff = (logits_of(model, changed, attn) - base).abs().amax(-1)
            assert diff[: 4 * b].max() == 0 if b else True  # earlier blocks never see it
            assert (diff[4 * b: 4 * b + 4] > 0).all()         # its whole block sees it (both directions)
            assert (diff[4 * b + 4:] > 0).all()               # later blocks see it


def test_gradient_checkpointing_same_gradients():
    model = model_of(MOE).train()
    ids = torch.randint(0, 64, (20,))
    attn = VarlenAttention.from_lengths([8, 12])
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        logits_of(model, ids, attn).logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads):
        assert torch.allclose(g0, g1, rtol=0, atol=1e-10)     # float64, gradients < 1: measured 0 (same ops)


def test_bf16_attention_on_cpu_is_float32_in_the_engine_and_pytorchs_bf16_kernel_in_training():
    from arbor.models.attention import sdpa
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 5, 4, 8).bfloat16(), torch.randn(3, 9, 2, 8).bfloat16(), torch.randn(3, 9, 2, 8).bfloat16())
    mask = torch.rand(3, 1, 5, 9) > 0.3
    mask[..., 0] = True
    with torch.inference_mode():
        out = sdpa(q, k, v, 0.35, mask=mask)
        ref = sdpa(q.float(), k.float(), v.float(), 0.35, mask=mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())   # one rounding, at the output
    train = sdpa(q, k, v, 0.35, mask=mask)                                      # PyTorch's own bfloat16 SDPA
    direct = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                            scale=0.35, enable_gqa=True).transpose(1, 2)
    assert train.dtype == torch.bfloat16 and torch.equal(train, direct)
