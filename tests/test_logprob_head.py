"""The fused log-prob head (``arbor.train.logprobs.LogprobHead``): the same log-probs, entropies and
gradients as the plain chunked path (float64 to rounding; bf16 autocast within bf16's own noise), it
keeps O(T) for the backward where autograd's path keeps [T, V], and it steps aside where it would differ."""

import contextlib
import copy
from unittest import mock

import pytest
import torch

from arbor.models import CausalLM, ModelConfig, VarlenAttention
from arbor.models.lora import LoRAConfig, apply_lora
from arbor.models.sampling import SamplingSpec
from arbor.train import logprobs
from arbor.train.logprobs import fused_temperature, gather_logprobs
from arbor.train.precision import autocast

CFG = dict(architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
T = 96


def plain_path():
    """gather_logprobs without the fused head: the reference."""
    return mock.patch.object(logprobs, "fused_temperature", lambda model, spec: None)


def model(tied: bool, dtype=torch.float64) -> CausalLM:
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(**CFG, tie_word_embeddings=tied)).to(dtype)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.3)        # logits of order 1–10: a peaked softmax, not a flat one
    return m


def head_run(m, fused: bool, spec=None, ctx=None, chunk=7) -> dict:
    """→ log-probs, entropies and every gradient of Σ w_i logp_i over one packed forward of ``m``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG["vocab_size"], (T,), generator=g)
    w = torch.randn(T, generator=g, dtype=torch.float64)
    m.zero_grad(set_to_none=True)
    ent = []
    with contextlib.nullcontext() if fused else plain_path(), ctx if ctx is not None else contextlib.nullcontext():
        hidden = m(ids, VarlenAttention.from_lengths([T])).hidden
        hidden.retain_grad()
        lp = gather_logprobs(m, hidden, torch.roll(ids, -1), chunk=chunk, spec=spec, entropy=ent)
    assert (type(lp.grad_fn).__name__ == "LogprobHeadBackward") == fused
    (lp * w.to(lp.dtype)).sum().backward()
    return dict(logp=lp.detach(), entropy=torch.cat(ent), hidden=hidden.grad,
                **{n: p.grad for n, p in m.named_parameters() if p.requires_grad})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("spec", [None, SamplingSpec(temperature=0.7)], ids=["own", "temperature"])
@pytest.mark.parametrize("frozen_head", [False, True], ids=["head-trains", "head-frozen"])
def test_fused_head_equals_the_plain_path_in_float64(tied, spec, frozen_head, one_thread):
    m = model(tied)
    m.lm_head.weight.requires_grad_(not frozen_head)     # frozen: the eager backward (LoRA's case)
    fused, plain = head_run(m, True, spec), head_run(m, False, spec)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"     # tied: one parameter, the embedding's name
    assert fused.keys() == plain.keys() and (head in fused) != frozen_head
    for name in plain:
        # float64: only the order of sums differs; relative to the tensor's largest entry (up to ~200 for
        # the gradients) measured ≤ 2.9e-15
        scale = max(1.0, plain[name].abs().max().item())
        torch.testing.assert_close(fused[name], plain[name], atol=1e-12 * scale, rtol=0, msg=name)


@pytest.mark.parametrize("frozen_head", [False, True], ids=["head-trains", "head-frozen"])
def test_fused_head_under_bf16_autocast_is_within_bf16_noise_of_the_plain_path(frozen_head, one_thread):
    m = model(tied=True, dtype=torch.float32)
    m.lm_head.weight.requires_grad_(not frozen_head)
    exact = head_run(copy.deepcopy(m).double(), False)
    fused = head_run(m, True, ctx=autocast("bfloat16", "cpu"))
    plain = head_run(m, False, ctx=autocast("bfloat16", "cpu"))
    # Bound. Each path is the exact value plus its own bf16 rounding (unit roundoff 2^-9 on the logits, on the
    # 16-bit G = g(onehot − softmax) and on every matmul of the backbone); the plain path's error against a
    # float64 copy, measured per tensor on every run, is that noise. So |fused − exact| ≲ noise and, by the
    # triangle inequality, |fused − plain| ≲ 2 noise; allowed: 2× and 3× (measured ≤ 1.3× and ≤ 1.6×, the
    # eager backward's ∂h rounding G at g = 1 — ∂W sums its chunks in float32, closer than one bf16 matmul).
    for name in plain:
        noise = (plain[name] - exact[name]).abs().max().item()
        off = (fused[name] - exact[name]).abs().max().item()
        gap = (fused[name] - plain[name]).abs().max().item()
        assert off <= 2 * noise and gap <= 3 * noise, (name, off, gap, noise)
    # both round the same bf16 logits: log-probs agree to float32 roundoff (|logp| ≤ 30: measured 1.9e-6)
    assert (fused["logp"] - plain["logp"]).abs().max() < 1e-4

def saved_tensors(fn) -> tuple[list[torch.Tensor], torch.Tensor]:
    """→ (the tensors autograd saves while ``fn`` runs, what ``fn`` returns)."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        out = fn()
    return seen, out


@pytest.mark.parametrize("frozen_head", [False, True], ids=["head-trains", "head-frozen"])
def test_fused_head_saves_O_T_not_O_T_times_V(frozen_head, one_thread):
    t, d, v = 256, 32, 8192
    m = CausalLM(ModelConfig(**(CFG | dict(hidden_size=d, vocab_size=v, head_dim=8)), tie_word_embeddings=False))
    m.lm_head.weight.requires_grad_(not frozen_head)
    params = {p.data_ptr() for p in m.parameters()}
    hidden = torch.randn(t, d, requires_grad=True)
    y = torch.randint(0, v, (t,))
    one_tv = t * v * 4                                                  # one [T, V] float32 tensor: 8 MiB

    def size(seen):
        return sum(x.numel() * x.element_size() for x in seen if x.data_ptr() not in params)

    fused, lp = saved_tensors(lambda: gather_logprobs(m, hidden, y, chunk=64))
    assert type(lp.grad_fn).__name__ == "LogprobHeadBackward"
    assert size(fused) <= t * (d * 4 + 16) < one_tv / 100             # h or D [T, D]; y, logsumexp [T]
    with plain_path():
        plain, _ = saved_tensors(lambda: gather_logprobs(m, hidden, y, chunk=64))
    assert size(plain) >= one_tv                                        # the hook sees autograd's [T, V]


def test_the_fused_head_steps_aside_where_it_would_differ():
    m = model(tied=False, dtype=torch.float32)
    assert fused_temperature(m, None) == 1.0
    assert fused_temperature(m, SamplingSpec()) == 1.0 == fused_temperature(m, SamplingSpec(temperature=0))
    assert fused_temperature(m, SamplingSpec(temperature=0.6)) == 0.6
    for spec in (SamplingSpec(top_k=20), SamplingSpec(top_p=0.9), SamplingSpec(min_p=0.1)):
        assert fused_temperature(m, spec) is None, spec                 # truncation: the plain path
    capped = copy.deepcopy(m)
    capped.logits = lambda hidden: 30 * torch.tanh(capped.lm_head(hidden) / 30)   # another ``logits``
    assert fused_temperature(capped, None) is None
    biased = copy.deepcopy(m)
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(CFG["vocab_size"]))
    assert fused_temperature(biased, None) is None
    lora = copy.deepcopy(m)
    apply_lora(lora, LoRAConfig(rank=4, targets=["lm_head"]))
    assert fused_temperature(lora, None) is None                        # a LoRALinear head
    hidden = torch.randn(5, CFG["hidden_size"])
    lp = gather_logprobs(lora, hidden, torch.arange(5))
    assert torch.allclose(lp, lora.logits(hidden).log_softmax(-1)[torch.arange(5), torch.arange(5)])
