"""LoRA (``arbor.models.lora``, ``arbor.train.lora``): PEFT reads our adapters onto the transformers
base with equal logits, merging computes the same function, only adapters train, SFT with adapters
resumes bit for bit, bad targets and other bases are refused."""

import copy

import pytest
import torch

from arbor.models import CausalLM, ModelConfig, load_model, save_model
from arbor.models.lora import LoRAConfig, apply_lora, lora_modules, merge_lora, save_adapter
from arbor.train.optim import OptimConfig, make_optimizer
from arbor.train.sft import SFTConfig, sft
from tests.conftest import hf_config
from tests.test_models_hf import arbor_logits, assert_matches
from tests.test_sft import SMALL, examples
from tests.test_train_resume import assert_same_weights, crash_then_resume


def qwen3(seed=3) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_hf(hf_config("qwen3").to_dict() | {"architectures": ["Qwen3ForCausalLM"]})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def adapted(model, **kw) -> CausalLM:
    """``model`` with adapters whose B is random (a fresh B = 0 would test nothing)."""
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, **kw))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0, 0.1)
    return model


def test_peft_loads_the_adapter_onto_the_transformers_base_with_equal_logits(tmp_path):
    import transformers as tf
    from peft import PeftModel
    model = qwen3()
    save_model(model, tmp_path / "base")
    adapted(model, targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    save_adapter(model, tmp_path / "adapter", tmp_path / "base")
    hf = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float(),
                                   tmp_path / "adapter").eval()
    assert len([n for n, _ in hf.named_modules() if n.endswith(".lora_A")]) == 5 * 4
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base_logits = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float()(ids).logits
        peft_logits = hf(ids).logits
        assert (peft_logits - base_logits).abs().max() > 1e-2        # the adapter does change the function
        assert_matches(peft_logits, model, ids)


def test_merged_model_and_adapter_folder_compute_the_adapted_function(tmp_path):
    model = qwen3()
    save_model(model, tmp_path / "base")
    adapted(model.double())
    save_adapter(model, tmp_path / "adapter", tmp_path / "base")
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = arbor_logits(model, ids)
        merged = arbor_logits(merge_lora(copy.deepcopy(model)), ids)
        loaded = arbor_logits(load_model(tmp_path / "adapter").double(), ids)   # base (float32 file) + adapter, merged
    assert (merged - want).abs().max() < 1e-12                       # float64: only summation order differs
    # the saved base is float32: its rounding (≤ 2^-24 relative on weights ≲ 0.5) moves logits ≲ 2.3 by ~1e-6
    assert (loaded - want).abs().max() < 1e-4
    assert ModelConfig.from_file(tmp_path / "adapter").hidden_size == model.config.hidden_size


def test_only_adapters_get_gradients_and_optimizer_state():
    tok, ex = examples(16)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = apply_lora(model, LoRAConfig(rank=2, targets=["q_proj", "gate_proj"]))
    assert names == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.gate_proj")]
    optimizer = make_optimizer(model, OptimConfig())
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        2 * (m.in_features + m.out_features) for m in lora_modules(model).values())
    sft(model, ex, SFTConfig(steps=3, batch_tokens=400, checkpoint_every=0, optim=OptimConfig(lr=1e-2, warmup_steps=0)))
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, before[n]), n
    assert all(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())


def test_bad_targets_name_the_linear_modules_that_exist():
    model = qwen3()
    with pytest.raises(ValueError, match=r"\['qproj'\].*'down_proj'.*'q_proj'"):
        apply_lora(model, LoRAConfig(rank=2, targets=["qproj"]))
    tok = examples(1)[0]
    tied = CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id))
    with pytest.raises(ValueError, match="ties"):
        apply_lora(tied, LoRAConfig(rank=2, targets=["lm_head"]))
    with pytest.raises(ValueError, match="lora.rank"):
        from arbor import configs
        from arbor.train.sft import SFTRunConfig
        configs.load(SFTRunConfig, None, ["lora.rank=-1"])


def test_sft_with_adapters_resumes_bit_for_bit(tmp_path):
    tok, ex = examples(32)

    def make():
        torch.manual_seed(0)
        model = CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id))
        apply_lora(model, LoRAConfig(rank=4))
        model.lora_base = str(tmp_path)
        return model

    cfg = SFTConfig(steps=7, batch_tokens=600, log_every=2, checkpoint_every=2, optim=OptimConfig(lr=1e-2, warmup_steps=2))
    whole, resumed = crash_then_resume(make, lambda m, until, folder: sft(m, ex, cfg, until=until, checkpoint_dir=folder),
                                       tmp_path / "ckpt", crash_after=5)
    assert_same_weights(whole, resumed)
    assert sorted(p.name for p in (tmp_path / "ckpt" / "model").iterdir()) == ["adapter_config.json",
                                                                                "adapter_model.safetensors"]


def test_rl_with_adapters_rolls_out_the_merged_policy_and_trains_adapters_only(tmp_path, one_thread):
    """``arbor train lora.rank=4``: after every step the engine's plain copy holds W + s·B A (the
    float32 train/infer log-prob gap stays at rounding, ~1e-7, while the adapters move the policy),
    and the base weights never change."""
    import asyncio

    from arbor.models.tokenizer import builtin_tokenizer
    from arbor.train.run import build_trainer
    from tests.test_rl_loop import config
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    save_model(CausalLM(ModelConfig(**SMALL, eos_token_id=tok.eos_token_id)), tmp_path / "base", tokenizer=tok)
    trainer = build_trainer(config(tmp_path / "rl", model=str(tmp_path / "base"), lora=LoRAConfig(rank=4),
                                   optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0)))
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    rows = [asyncio.run(trainer.train_step()) for _ in range(4)]
    assert sum(r["grad_norm"] > 0 for r in rows) >= 2
    served = trainer.engine.engine.model.state_dict()
    moved = 0.0
    for n, m in lora_modules(trainer.model).items():
        assert torch.equal(served[f"{n}.weight"], m.merged_weight()), n
        moved = max(moved, float((m.merged_weight() - m.weight).abs().max()))
    assert moved > 1e-3
    assert all(r["mismatch_abs"] < 1e-5 for r in rows), [r["mismatch_abs"] for r in rows]
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)


def test_cli_sft_with_adapters_then_export_merge_and_resume_onto_another_base(tmp_path, capsys):
    from arbor.cli import main as cli_main
    from tests.server_helpers import tiny_folder
    a, b = tiny_folder(tmp_path / "a", seed=0), tiny_folder(tmp_path / "b", seed=1)
    words = ["sft", "train.steps=2", "train.batch_tokens=300", "train.checkpoint_every=1", "log.progress=false",
             "lora.rank=4", "lora.targets=[\"q_proj\",\"v_proj\"]", "demos=50"]
    assert cli_main([*words, f"model={a}", f"out={tmp_path / 'sft'}"]) == 0
    assert (tmp_path / "sft" / "adapter_config.json").is_file() and not (tmp_path / "sft" / "config.json").exists()
    assert cli_main(["export", str(tmp_path / "sft"), str(tmp_path / "plain")]) == 2          # an adapter needs --merge
    assert "--merge" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "sft"), str(tmp_path / "plain"), "--merge"]) == 0
    plain, via_adapter = load_model(tmp_path / "plain"), load_model(tmp_path / "sft")
    assert_same_weights(plain, via_adapter)
    assert not torch.equal(plain.model.layers[0].self_attn.q_proj.weight, load_model(a).model.layers[0].self_attn.q_proj.weight)
    # the same out with another base: the checkpoint is refused, naming both bases
    assert cli_main([*words, "train.steps=4", f"model={b}", f"out={tmp_path / 'sft'}"]) == 2
    err = capsys.readouterr().err
    assert str(a) in err and str(b) in err and "delete" in err


def test_default_targets_adapt_the_projections_an_moe_model_has():
    from tests.test_rl_loop import SMALL as RL_SMALL
    moe = CausalLM(ModelConfig(**RL_SMALL | dict(architecture="Qwen3MoeForCausalLM", num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32)))
    names = apply_lora(moe, LoRAConfig(rank=2))          # fused experts are not linears: attention only
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
