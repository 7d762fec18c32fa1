"""SFT: tree-packed micro-batches train exactly what packed trajectories train; loss falls;
``run_sft`` writes an HF folder and passes demonstration options to the task."""

import copy

import torch

from arbor.models import CausalLM, ModelConfig, load_model
from arbor.models.tokenizer import builtin_tokenizer
from arbor.data.tools import tool_from_function
from arbor.rollout.chat import transcript_ids
from arbor.tasks import arithmetic
from arbor.train.optim import OptimConfig
from arbor.train.sft import SFTConfig, SFTRunConfig, run_sft, sft
from arbor.train.tree_batch import TreeConfig

SMALL = dict(architecture="Qwen3ForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def examples(n=64):
    tok, tools = builtin_tokenizer(), [tool_from_function(arithmetic.calc).schema]
    return tok, [transcript_ids(tok, row["messages"], tools) for row in arithmetic.rows(n, seed=0)]


def test_tree_sft_equals_packed_sft():
    tok, ex = examples()
    torch.manual_seed(0)
    a = CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id)).double()   # float64: only the order of sums differs
    b = copy.deepcopy(a)
    cfg = dict(steps=3, batch_tokens=1500, optim=OptimConfig(lr=1e-3, warmup_steps=0))
    ha = sft(a, ex, SFTConfig(tree=TreeConfig(token_cap=800), **cfg))
    hb = sft(b, ex, SFTConfig(tree=TreeConfig(enabled=False, token_cap=800), **cfg))
    assert abs(ha[-1]["loss"] - hb[-1]["loss"]) < 1e-10            # float64, loss ~4.5: measured 9e-16
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-10, rtol=0, msg=name)   # float64, weights ≤ ~1: measured 5e-15


def test_moe_sft_with_the_load_balancing_loss_trains_the_same_as_a_tree():
    tok, ex = examples(32)
    torch.manual_seed(0)
    a = CausalLM(ModelConfig(**SMALL | dict(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32), eos_token_id=tok.eos_token_id)).double()
    b, c = copy.deepcopy(a), copy.deepcopy(a)                        # float64: only the order of sums differs
    cfg = dict(steps=2, batch_tokens=1000, log_every=1, optim=OptimConfig(lr=1e-3, warmup_steps=0))
    ha = sft(a, ex, SFTConfig(tree=TreeConfig(token_cap=600), moe_aux_coef=0.5, **cfg))
    hb = sft(b, ex, SFTConfig(tree=TreeConfig(enabled=False, token_cap=600), moe_aux_coef=0.5, **cfg))
    hc = sft(c, ex, SFTConfig(tree=TreeConfig(token_cap=600), **cfg))
    assert 0.9 < ha[0]["moe_aux"] < 2 and abs(ha[-1]["moe_aux"] - hb[-1]["moe_aux"]) < 1e-10 and "moe_aux" not in hc[0]  # f64: 0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-10, rtol=0, msg=name)   # float64, weights ≤ ~1: measured 2e-15
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(dict(a.named_parameters())[gate], dict(c.named_parameters())[gate])


def test_sft_lowers_the_loss():
    tok, ex = examples()
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id))
    hist = sft(model, ex, SFTConfig(steps=30, batch_tokens=1500, log_every=29, optim=OptimConfig(lr=3e-3, warmup_steps=5)))
    assert hist[-1]["loss"] < 0.6 * hist[0]["loss"]


def test_run_sft_writes_a_loadable_folder_and_uses_demo_options(tmp_path, monkeypatch):
    seen = []
    real = arithmetic.rows

    def spy(n, seed, split="train", **kw):
        seen.append(kw)
        return real(n, seed, split, **kw)

    monkeypatch.setattr(arithmetic, "rows", spy)
    cfg = SFTRunConfig(model="tiny", demos=16, out=str(tmp_path / "sft"), demo_options={"mental_rate": 0.5},
                       train=SFTConfig(steps=2, batch_tokens=600))
    model, tok, hist = run_sft(cfg)
    assert seen == [{"mental_rate": 0.5}]
    loaded = load_model(tmp_path / "sft", dtype=torch.float32)
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)       # float32 saved and loaded: bit for bit


def test_until_ends_sft_after_the_step_it_says_stop():
    tok, ex = examples(16)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id))
    seen = []
    hist = sft(model, ex, SFTConfig(steps=10, batch_tokens=400, log_every=100),
               until=lambda step: seen.append(step) or step == 3)
    assert seen == [0, 1, 2, 3] and hist[-1]["step"] == 3
