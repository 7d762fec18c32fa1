"""``arbor generate`` (autoregressive checkpoints) and the ``arbor serve`` parser."""

import pytest
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
    assert main(["generate", str(tmp_path / "m"), "engine.max_model_len=64", "Hi", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("Hi" + ref.text + "\t[")       # engine.KEY=VALUE words are not prompts
    assert main(["generate", str(tmp_path / "m"), "engine.policy=fastest", "Hi"]) == 2
    assert "pd-global-enqueue" in capsys.readouterr().err


def serve_config(argv):
    """The ``ServeConfig`` an ``arbor serve`` command line gives (what ``_run_serve`` loads)."""
    from arbor.cli.common import flag_words as _flag_words
    from arbor.cli.serving import SERVE_FLAGS
    from arbor.serve.config import load_serve_config
    args, extra = build_parser().parse_known_args(argv)
    words = args.overrides + extra
    return load_serve_config(args.model, None, [*words, *_flag_words(args, SERVE_FLAGS)])


def test_serve_parser():
    cfg = serve_config(["serve", "some/folder", "--port", "9001", "--policy", "prefill-first"])
    assert cfg.port == 9001 and cfg.engine.policy == "prefill-first" and cfg.host == "127.0.0.1"
    cfg = serve_config(["serve", "m", "port=9002", "--policy", "mixed", "engine.max_model_len=128", "server.max_n=4"])
    assert (cfg.port, cfg.engine.policy, cfg.engine.max_model_len, cfg.server.max_n) == (9002, "mixed", 128, 4)
    assert serve_config(["serve", "m", "engine.policy=layerkv", "--policy", "mixed"]).engine.policy == "mixed"


def test_serve_takes_every_engine_key_and_checks_them_once(capsys, tmp_path):
    cfg = serve_config(["serve", "m", "engine.layer_kv=true", "engine.device_kv_blocks=64", "--policy", "layerkv",
                        "engine.tpot_slo=0.05", "engine.ttft_slo=2"])
    assert cfg.engine.layer_kv and cfg.engine.device_kv_blocks == 64 and cfg.engine.tpot_slo == 0.05
    assert cfg.engine.ttft_slo == 2.0
    assert main(["serve", "no/such/folder", "--policy", "layerkv", "engine.tpot_slo=0.05"]) == 2
    assert "needs layer_kv=True" in capsys.readouterr().err
    with pytest.raises(SystemExit):                                    # the registry's names are the choices
        main(["serve", "m", "--policy", "fastest"])
    assert "pd-global-enqueue" in capsys.readouterr().err
    assert main(["serve", "m", "engine.no_such_knob=1"]) == 2
    assert "unknown key 'engine.no_such_knob'" in capsys.readouterr().err
    (tmp_path / "serve.toml").write_text("port = 9100\n[engine]\nmax_num_seqs = 8\n")
    assert main(["serve", "no/such/folder", str(tmp_path / "serve.toml"), "engine.policy=layerkv"]) == 2
    assert "needs layer_kv=True" in capsys.readouterr().err


def test_python_dash_m_arbor_is_the_arbor_command():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "arbor", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "generate" in run.stdout
