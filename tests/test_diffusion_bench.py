"""The dLLM benchmark's accounting: forwards split into M2T and edit-only steps, blocks visited, TPF
ceilings, and the first-step confidence bands checked against what the decoders actually unmask.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import pytest
import torch

from arbor.bench.dllm import blocks_decoded, evaluate, first_step_confidence
from arbor.dllm.decoding import DecodeConfig, diffusion_generate, quality, speed
from arbor.models.tokenizer import builtin_tokenizer
from arbor.tasks import addition
from arbor.dllm.sft import DiffusionModelConfig, build_model

TINY = DiffusionModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, block_size=8)


@pytest.fixture(scope="module")
def setup():
    tok = builtin_tokenizer()
    model = build_model(tok, TINY, seed=1).eval()
    with torch.no_grad():                       # spread the confidences over (0, 1)
        for p in model.parameters():
            p.normal_(0, 1.5)
    return tok, model, addition.generate(6, seed=0, split="test")


def test_blocks_decoded_by_hand():
    # prompt 12 tokens, block 8: response starts in block 1; a stop at response index 4 is position 16, block 2
    assert blocks_decoded(12, 4, 6, 8) == 2 and blocks_decoded(12, 3, 6, 8) == 1
    assert blocks_decoded(12, 6, 6, 8) == 2 and blocks_decoded(16, 0, 10, 8) == 1


def test_forwards_split_and_tpf_ceilings(setup):
    tok, model, problems = setup
    for cfg, editing in ((quality(block_size=8), True), (speed(block_size=8), True),
                         (DecodeConfig(method="threshold", threshold=0.3), False)):
        r = evaluate(model, tok, "addition", problems, cfg)
        assert r["m2t_forwards"] + r["edit_only_forwards"] == pytest.approx(r["forwards"])
        assert r["m2t_forwards"] >= r["blocks"] >= 1
        if editing:      # every block: ≥ 1 step that fills it, ≥ 1 edit-only check
            assert r["edit_only_forwards"] >= r["blocks"] and r["tpf"] <= r["tpf_ceiling_editing"] + 1e-9
        else:
            assert r["edit_only_forwards"] == 0 and r["tpf"] <= r["tpf_ceiling"] + 1e-9
        assert r["tpf_ceiling"] == pytest.approx(2 * r["tpf_ceiling_editing"])


def test_confidence_bands_match_what_speed_and_quality_unmask_first(setup):
    tok, model, problems = setup
    seen_middle = False
    for p in problems:
        band = first_step_confidence(model, tok, "addition", [p])
        assert band["low"] + band["middle"] + band["high"] == pytest.approx(1.0)
        prompt = tok.encode(p.prompt)
        n = min((len(prompt) // 8 + 1) * 8, len(prompt) + addition.GEN_LENGTH) - len(prompt)
        for cfg, share in ((speed(block_size=8), band["middle"] + band["high"]), (quality(block_size=8), band["high"])):
            r = diffusion_generate(model, [prompt], cfg, gen_length=addition.GEN_LENGTH, record=True)[0]
            unmasked = int((r.trajectory[0][:n] != model.config.mask_token_id).sum())
            assert unmasked == max(1, round(share * n))
        seen_middle |= band["middle"] > 0
    assert seen_middle
