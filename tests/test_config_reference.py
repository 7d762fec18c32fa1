"""docs/config.md is what ``python -m arbor.cli.reference`` generates from the config dataclasses today."""

from pathlib import Path

from arbor.cli.reference import DEFAULT_PATH, reference_text

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_current():
    committed = (ROOT / DEFAULT_PATH).read_text()
    assert committed == reference_text(), ("docs/config.md is stale: run `python -m arbor.cli.reference` "
                                           "(or `make docs`) and commit it")


def test_reference_lists_every_job_and_nested_key():
    text = reference_text()
    for command in ("sft", "train", "demo", "dllm-train", "dllm-distill", "serve"):
        assert f"## `arbor {command}`" in text
    assert "| `engine.policy` |" in text and "| `rl.engine.dtype` |" in text and "| `cluster.backend` |" in text
