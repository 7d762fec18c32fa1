"""The one-call decode step (``arbor.engine.decode_stack``): the hidden states of every decode step it serves
equal the module path's bit for bit (same C kernels, same order), before and after a weight update; steps
and models it does not serve take the module path."""

import pytest
import torch

from arbor.engine import EngineConfig, LLMEngine, SamplingParams
from arbor.engine.decode_stack import DecodeStack
from tests.test_engine_cpu_kernels import PROMPTS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def engine(model, dtype):
    eng = LLMEngine(model, EngineConfig(dtype=dtype, num_blocks=64, block_size=16, share_weights=False))
    if eng.runner.decode_stack is None:
        pytest.skip(f"the decode stack does not serve {dtype} here (no C compiler, or no AVX-512"
                    f"{' BF16, or AMX' if dtype == 'bfloat16' else ''} for the few-row kernel)")
    return eng


def checked(monkeypatch) -> list[bool]:
    """Every ``DecodeStack.run`` also runs the module path on the same step: → one equality flag per step."""
    flags, real = [], DecodeStack.run

    def both(self, input_ids, positions, attn):
        got = real(self, input_ids, positions, attn)
        ref = list(self.model.forward_segments(input_ids, attn, len(self.model.model.layers), positions))[-1][1]
        flags.append(torch.equal(got, ref.hidden))
        return got

    monkeypatch.setattr(DecodeStack, "run", both)
    return flags


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family,changes", [("qwen3", {}), ("qwen3", dict(attention_bias=True)), ("qwen2", {}),
                                            ("llama", {})])
def test_decode_steps_equal_the_module_path_bit_for_bit(dtype, family, changes, monkeypatch):
    """Ragged contexts across block boundaries (prompts of 3–40 tokens, 24 new), sampled, then again after
    ``update_weights`` (the stack reads the re-packed weights). Qwen3 with q/k norms (and q/k/v/o biases);
    Qwen2 (q/k/v biases) and Llama (biases in every linear, Llama 3 RoPE scaling) rotate without a norm."""
    model = tiny_model(family, **changes)
    eng = engine(model, dtype)
    flags = checked(monkeypatch)
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    first = eng.generate(PROMPTS, params)
    assert len(flags) >= 20 and all(flags), flags
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    eng.update_weights(list(model.state_dict().items()))
    flags.clear()
    second = eng.generate(PROMPTS, params)
    assert len(flags) >= 20 and all(flags), flags
    assert [o.token_ids for o in first] != [o.token_ids for o in second]      # the new weights were used
    eng.runner.decode_stack = None                  # the module path alone gives the same tokens
    assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [o.token_ids for o in second]


def test_prefill_and_mixed_steps_take_the_module_path(monkeypatch):
    eng = engine(tiny_model("qwen3"), "float32")
    flags = checked(monkeypatch)
    served = []
    real = eng.runner.decode_stack.serves
    monkeypatch.setattr(eng.runner.decode_stack, "serves", lambda attn, rows: served.append(
        (attn.num_decodes, rows, real(attn, rows))) or served[-1][2])
    eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert any(ok for *_, ok in served) and all(ok == (nd == rows) for nd, rows, ok in served)
    assert len(flags) == sum(ok for *_, ok in served) and all(flags)


def test_models_it_does_not_serve():
    """MoE layers: the module path; a shared (not engine-owned) model as well."""
    model = tiny_model("qwen3", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert LLMEngine(model, EngineConfig(num_blocks=64, share_weights=False)).runner.decode_stack is None
    assert LLMEngine(tiny_model("qwen3"), EngineConfig(num_blocks=64)).runner.decode_stack is None
