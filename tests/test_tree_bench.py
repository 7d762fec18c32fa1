"""``arbor bench tree`` runs end to end on a tiny setting and writes JSON + PNG.

Tolerances: the values are float64 (numpy / Python) sums of at most a few hundred terms of size ≤ 1e3, whose
rounding is ≲ 1e-13: absolute 1e-12 / 1e-9 and relative 1e-12 / 1e-9 (pytest.approx's default 1e-6) hold it with room."""

import json

from arbor.bench import tree


def test_bench_tree_smoke(tmp_path):
    result = tree.run(out_dir=tmp_path, trees=1, prompt=16, turns=1, repeats=1, kinds=("hybrid",), threads=1)
    stats = result["trees"]
    assert stats["total_tokens"] > stats["compact_tokens"] and abs(
        stats["ideal_speedup"] - stats["total_tokens"] / stats["compact_tokens"]) < 1e-12
    for key in ("hybrid", "hybrid+recompute"):
        s = result["systems"][key]
        assert s["speedup"] > 0 and s["memory_bytes"]["tree"] > 0
    assert json.loads((tmp_path / "tree.json").read_text())["benchmark"] == "tree"
    assert (tmp_path / "tree.png").stat().st_size > 0
