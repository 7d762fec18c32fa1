"""Expert migration on 2 ranks (tests/routepack_cases.py in child processes under a hard timeout)."""

import sys
from pathlib import Path

from arbor.dist.launch import launch

CASES = str(Path(__file__).with_name("routepack_cases.py"))


def test_migration_is_bit_identical_to_not_migrating_and_resumes(tmp_path):
    result = launch([sys.executable, CASES, "migrate", str(tmp_path)], 2, threads=1, timeout_s=90, echo=None)
    text = "\n".join(f"[rank {r}] {line}" for r in range(2) for line in result.output[r])
    assert result.returncode == 0, text
    assert text.count("migration: outputs, weights and moments bit-identical") == 2, text
    assert text.count("resume after migration: bit-identical") == 2, text
