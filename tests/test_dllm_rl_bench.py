"""`arbor bench dllm-rl` end to end on a tiny untrained base: runs, writes JSON (with targets) and PNG."""

import json

from arbor.bench.dllm import BLOCK_SIZE, DATA_VERSION
from arbor.cli import main as cli_main
from arbor.models import save_model
from arbor.models.tokenizer import builtin_tokenizer
from arbor.dllm.sft import DiffusionModelConfig, build_model


def test_bench_runs_and_writes_targets(tmp_path):
    tok = builtin_tokenizer()
    tiny = DiffusionModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, block_size=BLOCK_SIZE)
    save_model(build_model(tok, tiny), tmp_path / "cache" / f"v{DATA_VERSION}_base_b{BLOCK_SIZE}_s3", tokenizer=tok)
    cli_main(["bench", "dllm-rl", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--base-steps", "3",
              "--tasks", "countdown", "--seeds", "1", "--steps", "2", "--groups", "2", "--group-size", "2",
              "--eval-n", "4", "--eval-every", "1", "--rollout-mode", "threshold", "--oracle-steps", "2"])
    result = json.loads((tmp_path / "out" / "dllm-rl.json").read_text())
    assert {t["name"].split(" ")[0] for t in result["targets"]} == {"EBPO"} and len(result["targets"]) == 3
    assert {r["estimator"] for r in result["runs"]} == {"ebpo", "espo", "mean_field", "oracle_sft"}   # default systems
    assert {"countdown/sft_base", "countdown/ebpo", "countdown/espo", "countdown/mean_field",
            "countdown/oracle_sft"} <= set(result["summary"])
    assert all(set(t) == {"name", "value", "target", "met"} for t in result["targets"])
    assert [s for s, _ in result["runs"][0]["curve"]] == [0, 1, 2]
    assert (tmp_path / "out" / "dllm-rl.png").exists()


def test_base_size_flags_pick_the_model_and_its_folder(tmp_path):
    from arbor.bench.dllm_rl import base_config
    import pytest
    assert base_config() == base_config(128, 3) == DiffusionModelConfig(block_size=BLOCK_SIZE)
    big = base_config(256, 4)
    assert (big.hidden_size, big.intermediate_size, big.num_attention_heads, big.num_key_value_heads,
            big.head_dim, big.num_hidden_layers) == (256, 512, 8, 4, 32, 4)
    for hidden, layers in ((96, 0), (-64, 0), (0, -1)):
        with pytest.raises(ValueError, match="--base-hidden"):
            base_config(hidden, layers)
