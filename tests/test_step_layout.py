"""The step layout of `arbor train` on 2 ranks (tests/layout_cases.py in child processes under a hard timeout):
samples move between ranks to balance their work (plan.layout=lpt, kk; plan.routepack=true also places the
experts), and the update equals one process's with every sample.

Tolerance: float64 throughout, only the summation order differs (which rank sums which sample's term, where an
expert lives): 1e-12 on weights of size ≲ 1 (measured below 2e-15), and rel 1e-10 on the logged metrics."""

import sys
from pathlib import Path

import pytest
import torch

from arbor.distributed.launch import launch

CASES = str(Path(__file__).with_name("layout_cases.py"))


@pytest.mark.multiprocess
@pytest.mark.numerics
@pytest.mark.parametrize("kind, layout, tree", [("dense", "lpt", "tree"), ("dense", "kk", "flat"),
                                                 ("moe", "lpt", "flat"), ("moe", "routepack", "flat"),
                                                 ("moe", "routepack", "tree")])
def test_a_layout_balances_the_ranks_and_the_update_equals_one_process(tmp_path, kind, layout, tree, one_thread):
    from tests.layout_cases import reference
    result = launch([sys.executable, CASES, "update", str(tmp_path), kind, layout, tree], 2, threads=1,
                    timeout_s=120, echo=None, grace_s=5)
    assert result.returncode == 0, "\n".join(f"[rank {r}] {line}" for r in range(2) for line in result.output[r])
    got = torch.load(tmp_path / "update.pt", weights_only=False)
    want, rows = reference(kind == "moe", layout, tree)
    worst = max(float((got["tensors"][k] - want[k]).abs().max()) for k in want)
    assert worst <= 1e-12, worst
    for key in ("loss", "grad_norm", "kl_ref", "approx_kl", "tokens"):
        assert [r[key] for r in got["rows"]] == pytest.approx([r[key] for r in rows], rel=1e-10), key
    # rank 0 rolled out twice rank 1's tokens; the layout evens them out (LPT: within the largest unit, 59 tokens)
    for k in range(2):                           # got["tokens"][rank][step]
        tokens = [per_rank[k] for per_rank in got["tokens"]]
        assert sum(tokens) == rows[0]["trained"] and max(tokens) - min(tokens) <= 59, got["tokens"]
    assert all(r["rank_tokens_max_over_mean"] < 1.3 for r in got["rows"])
    if layout == "routepack":
        assert got["rows"][0]["routepack_fallback"] == 0 and got["rows"][0]["routepack_moved"] > 0
        assert got["rows"][0]["ep_peak_after"] < got["rows"][0]["ep_peak_before"]
        assert any(r != [0, 0, 1, 1] for r in got["rank_of"].values())        # experts 0 and 1 no longer share a rank


def test_auto_layout_balances_tree_mode_runs_on_several_ranks():
    from arbor import configs
    from arbor.train.config import RLConfig
    from arbor.train.step_layout import resolve
    cfg = lambda *words: configs.load(RLConfig, None, list(words))
    assert resolve(cfg(), 2) == "lpt" and resolve(cfg(), 1) == "local"           # tree.enabled is the default
    assert resolve(cfg("tree.enabled=false"), 2) == "local"
    assert resolve(cfg("plan.layout=kk"), 2) == "kk" and resolve(cfg("plan.layout=local"), 4) == "local"
    assert resolve(cfg("plan.routepack=true"), 2) == "routepack"
    with pytest.raises(ValueError, match="plan.layout"):
        cfg("plan.routepack=true", "plan.layout=kk")
