"""Masked-diffusion SFT (sample construction, loss, training), built-in tasks, checkpoints, CLI."""

import json
import random

import pytest
import torch

from arbor.cli import main as cli_main
from arbor.dllm.decoding import generate_text, quality
from arbor.models import BlockDiffusionAttention, load_model
from arbor.models.tokenizer import builtin_tokenizer
from arbor.tasks import addition, countdown, sudoku
from arbor.dllm.sft import (DiffusionModelConfig, DiffusionTrainConfig, PaddedBlockAttention, build_model,
                                   diffusion_loss, noised_sample, reference_prompt, task_examples, train_diffusion)

TINY = DiffusionModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, block_size=8)


def test_tasks_generate_verifiable_problems():
    for p in sudoku.generate(20, seed=0):
        cells = [int(c) if c != "." else 0 for c in p.prompt[7:23]]
        assert sudoku.count_solutions(cells) == 1 and sudoku.is_valid([int(c) for c in p.answer])
        assert sudoku.score(p, p.answer) == 1.0
        wrong = "".join("1" if c == "." else a for c, a in zip(p.prompt[7:23], p.answer))
        assert sudoku.score(p, wrong) < 1.0
    for p in countdown.generate(20, seed=0):
        assert countdown.verify(p.numbers, p.target, p.answer) and countdown.solve(p.numbers, p.target) == p.answer
    assert not countdown.verify((3, 7, 12), 33, "3*7+11") and not countdown.verify((3, 7, 12), 33, "3*7*12+")
    assert countdown.verify((3, 7, 12), 33, "12+3*7") and countdown.solve((2, 2, 2), 100) is None
    for p in addition.generate(20, seed=0):
        w = addition.WIDTH
        assert addition.score(p, f"{p.a + p.b:0{w + 1}d}") == 1.0 and addition.score(p, f"{p.a + p.b + 1:0{w + 1}d}") == 0.0
        assert p.prompt == f"add:{p.a:0{w}d}+{p.b:0{w}d}=" and len(p.answer) < addition.GEN_LENGTH
    train, test = ({p.prompt for p in addition.generate(200, 0, s)} for s in ("train", "test"))
    assert not train & test


def test_noised_sample_mirrors_one_block_decoding_step():
    rng, B, mask = random.Random(0), 8, 103
    prompt, response = list(range(10, 15)), list(range(20, 32))        # positions 5..16: blocks 0, 1, 2
    for _ in range(50):
        ids, targets, w = noised_sample(prompt, response, rng, B, mask, [1, 2], 0.3, 1.0)
        end = len(ids)
        start = max(len(prompt), (end - 1) // B * B)
        assert end in (8, 16, 17) and ids[:start] == (prompt + response)[:start] and targets == (prompt + response)[:end]
        assert all(x == 0 for x in w[:start]) and all(x > 0 for x in w[start:])
        n = end - start
        vis = [x for i, x in zip(ids[start:], w[start:]) if i != mask]
        assert all(x == pytest.approx(1 / n) for x in vis)   # 1.0 / n in Python floats: equal up to the last bit
        masked = [x for i, x in zip(ids[start:], w[start:]) if i == mask]
        assert len(set(round(x, 9) for x in masked)) <= 1 and all(x >= 1 / n for x in masked)


def test_padded_attention_equals_block_diffusion_attention():
    tok = builtin_tokenizer()
    model = build_model(tok, TINY).double().eval()       # float64: the two masks' kernels sum in other orders
    lengths = [5, 17, 9, 16]
    ids = torch.randint(0, 90, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(ids, PaddedBlockAttention(lengths, 8)).hidden
        b = model(ids, BlockDiffusionAttention.from_lengths(lengths, 8)).hidden
    torch.testing.assert_close(a, b, atol=1e-10, rtol=0)   # float64, hidden ≲ 3: measured 6.7e-16


def test_reference_prompt_keeps_the_response_block_layout():
    tok = builtin_tokenizer()
    p = tok.encode("add:12+34=")
    ref = reference_prompt(tok, p, "46", 8)
    assert (len(ref) - len(p)) % 8 == 0 and ref[-len(p):] == p
    assert tok.decode(ref).startswith("Reference answer: 46")


def test_short_training_lowers_the_loss_and_saves_a_loadable_checkpoint(tmp_path):
    tok = builtin_tokenizer()
    _, examples = task_examples(tok, "addition", 64, 0, "train", TINY.block_size)
    model = build_model(tok, TINY)
    cfg = DiffusionTrainConfig(steps=60, batch_size=16, log_every=59, model=TINY)
    cfg.optim.lr, cfg.optim.warmup_steps = 3e-3, 5
    rng = random.Random(1)
    fixed = [noised_sample(e.prompt, e.response, rng, 8, tok.mask_token_id, [16, 17], 0.1, 1.0) for e in examples[:32]]
    with torch.no_grad():
        before = float(diffusion_loss(model, fixed))
    train_diffusion(model, examples, cfg)
    with torch.no_grad():
        after = float(diffusion_loss(model, fixed))
    assert after < 0.6 * before
    from arbor.models import save_model
    save_model(model, tmp_path / "m", tokenizer=tok)
    loaded = load_model(tmp_path / "m").eval()
    assert loaded.config.is_block_diffusion and loaded.config.block_size == 8
    prompts = ["add:012+034=", "add:005+070="]
    a = generate_text(model, tok, prompts, quality(block_size=None, gen_length=8))
    b = generate_text(loaded, tok, prompts, quality(block_size=None, gen_length=8))
    assert [x[1].tokens for x in a] == [x[1].tokens for x in b]


def test_cli_dllm_train_then_generate(tmp_path, capsys):
    out = tmp_path / "dllm"
    words = ["steps=2", "train_per_task=8", "batch_size=4", "model.hidden_size=32", "model.intermediate_size=64",
             "model.num_hidden_layers=1", "model.head_dim=8", "model.block_size=8"]
    assert cli_main(["dllm-train", f"out={out}", *words]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and {"loss", "lr", "grad_norm", "tokens", "seconds"} <= rows[0].keys()
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert cli_main(["generate", str(out), "add:1+2=", "--mode", "speed", "--editing-threshold", "none",
                     "--gen-length", "6"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("add:1+2=") and "forwards" in line and "0 edits" in line
    assert cli_main(["generate", str(out), "add:1+2=", "--mode", "speed", "--gen-length", "6", "--show-steps"]) == 0
    head, *steps = capsys.readouterr().out.strip().splitlines()
    forwards = int(head.split(" forwards")[0].split()[-1])
    assert len(steps) == forwards and steps[0].split()[:2] == ["step", "1"]
    assert sum(int(s.split("+")[-1].split()[0]) for s in steps) == 6          # every mask filled exactly once
    assert sum(int(s.split(", ")[-1].split()[0]) for s in steps) == int(head.split(" edits")[0].split()[-1])
    # an untrained teacher decodes no task correctly, so TAD must refuse rather than train on nothing
    assert cli_main(["dllm-distill", f"model={out}", f"out={tmp_path / 'tad'}", "per_task=2",
                     "tad.steps=2", "tad.batch_size=2"]) == 2
    assert "no correct teacher trajectory" in capsys.readouterr().err
    assert cli_main(["dllm-distill", f"model={out}", f"out={tmp_path / 'tad'}", "tasks=['chess']"]) == 2
    assert "tasks must name tasks of" in capsys.readouterr().err
