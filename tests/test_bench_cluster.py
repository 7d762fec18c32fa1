"""``arbor bench cluster``'s rollout-model flags: the toy stays reachable, bad shapes fail before any work."""

import pytest

from arbor.bench.cluster import model_config
from arbor.cli import main
from arbor.models.presets import preset_config
from arbor.models.tokenizer import builtin_tokenizer


def test_the_toy_shape_is_the_tiny_preset_and_the_default_is_the_engine_bench_shape():
    tok = builtin_tokenizer()
    assert model_config(tok, 128, 4, head_dim=32) == preset_config("tiny", tok)
    c = model_config(tok, 256, 4)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim) == (256, 768, 4, 4, 2, 64)
    assert len(c.layer_types) == 4 and c.vocab_size % 64 == 0 and c.eos_token_id == tok.eos_token_id
    assert len(model_config(tok, 256, 6).layer_types) == 6


BAD = [(["--hidden", "0"], "--hidden must be > 0"), (["--layers", "-1"], "--layers must be > 0"),
       (["--hidden", "32"], "--heads must be > 0"),           # 32 // head_dim 64 = 0 heads
       (["--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads (2)")]


@pytest.mark.parametrize("flags, says", BAD)
def test_a_bad_model_shape_is_refused_before_any_work(tmp_path, capsys, flags, says):
    assert main(["bench", "cluster", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *flags]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
