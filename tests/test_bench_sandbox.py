"""``arbor bench sandbox`` end to end at smoke size: every isolation that works here is timed, the
`before` sandbox comes from a git revision (HEAD's here: the mechanism, not the figure), and the
target is computed from the run."""

import json
import shutil
import subprocess

import pytest

from arbor.bench.sandbox import ROOT
from arbor.cli import main
from arbor.rollout.sandbox import network_isolation


def test_bench_sandbox_smoke(tmp_path):
    has_git = shutil.which("git") and subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode == 0
    if not has_git:
        pytest.skip("the `before` sandbox is taken from git")
    assert main(["bench", "sandbox", "--out", str(tmp_path), "--runs", "2", "--rounds", "1", "--baseline", "HEAD"]) in (0, None)
    r = json.loads((tmp_path / "sandbox.json").read_text())
    assert (tmp_path / "sandbox.png").exists() and r["benchmark"] == "sandbox"
    works = {m for m in ("bwrap", "unshare") if network_isolation(m) == m}
    assert set(r["systems"]) == {"before", "none"} | works
    assert all(len(s["times_s"]) == 2 and s["median_s"] > 0 for s in r["systems"].values())
    assert r["systems"]["none"]["isolation"] == "prelude" and r["systems"]["before"]["over_before"] == 1.0
    [t] = r["targets"]
    default = r["config"]["default_isolation"]
    if default in r["systems"]:
        assert t["value"] == pytest.approx(r["systems"][default]["median_s"] / r["systems"]["before"]["median_s"])
        assert t["met"] == (t["value"] <= 1.5)
