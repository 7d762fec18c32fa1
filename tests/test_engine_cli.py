"""``arbor generate`` (autoregressive checkpoints) and the ``arbor serve`` parser."""

import torch

from arbor.cli import build_parser, main
from arbor.engine import LLMEngine, SamplingParams
from arbor.models import CausalLM, ModelConfig, save_model
from arbor.models.tokenizer import builtin_tokenizer


def test_generate_prints_the_engine_completion(tmp_path, capsys):
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8,
                                 eos_token_id=tok.eos_token_id)).eval()
    save_model(model, tmp_path / "m", tokenizer=tok)
    assert main(["generate", str(tmp_path / "m"), "--prompt", "Hi", "--max-tokens", "5"]) == 0
    ref = LLMEngine(str(tmp_path / "m")).generate(["Hi"], SamplingParams(temperature=0, max_tokens=5))[0]
    assert capsys.readouterr().out.startswith("Hi" + ref.text + "\t[")
    assert main(["generate", str(tmp_path / "m"), "--prompt", "Hi", "--chat", "--temperature", "1", "--seed", "3",
                 "--max-tokens", "3"]) == 0
    assert main(["generate", str(tmp_path / "m")]) == 2
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "m"), "Hi", "--max-tokens", "5", "Ho"]) == 0   # prompts around options
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Hi" + ref.text + "\t[") and out[1].startswith("Ho")


def test_serve_parser():
    args = build_parser().parse_args(["serve", "some/folder", "--port", "9001", "--policy", "prefill-first"])
    assert args.port == 9001 and args.policy == "prefill-first" and args.model == "some/folder"


def test_serve_takes_the_layerkv_knobs_and_checks_them(capsys):
    from arbor.cli import main
    args = build_parser().parse_args(["serve", "m", "--layer-kv", "--device-kv-blocks", "64", "--policy", "layerkv",
                                      "--tpot-slo", "0.05", "--ttft-slo", "2"])
    assert args.layer_kv and args.device_kv_blocks == 64 and args.tpot_slo == 0.05 and args.ttft_slo == 2.0
    assert main(["serve", "no/such/folder", "--policy", "layerkv", "--tpot-slo", "0.05"]) not in (0, None)
    assert "needs layer_kv=True" in capsys.readouterr().err


def test_python_dash_m_arbor_is_the_arbor_command():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "arbor", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "generate" in run.stdout
