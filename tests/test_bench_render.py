"""The benchmark pages are the committed results, rendered: ``arbor bench render`` into a temp folder
gives the committed ``docs/benchmarks/*.md`` and the README's results table byte for byte (so a
re-run bench whose pages were not re-rendered fails here), every figure has its JSON, every result
says where it came from, and every relative link of the README and the guides resolves."""

import json
import re
import shutil
from pathlib import Path

from arbor.bench import render
from arbor.cli import BENCHMARKS, main

ROOT = Path(__file__).resolve().parents[1]
RESULTS, DOCS = ROOT / render.RESULTS, ROOT / render.DOCS
STALE = "run `arbor bench render` from the repository root and commit the pages"


def test_committed_pages_equal_a_fresh_render(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    assert main(["bench", "render", "--results", str(RESULTS), "--out", str(tmp_path / "docs"),
                 "--readme", str(readme)]) == 0
    rendered = {p.name: p.read_text() for p in (tmp_path / "docs").glob("*.md")}
    committed = {p.name: p.read_text() for p in DOCS.glob("*.md")}
    assert sorted(committed) == sorted(rendered), STALE
    for name, text in rendered.items():
        assert committed[name] == text, f"docs/benchmarks/{name} is stale: {STALE}"
    text = readme.read_text()
    assert render.BEGIN in text and render.END in text
    assert text == (ROOT / "README.md").read_text(), f"README.md's results table is stale: {STALE}"


def test_every_figure_has_its_json():
    figures = [p for folder in (DOCS, RESULTS) for ext in ("png", "svg", "jpg") for p in folder.glob(f"*.{ext}")]
    for fig in figures:
        assert (RESULTS / f"{fig.stem}.json").exists(), f"{fig.relative_to(ROOT)} has no {render.RESULTS}/{fig.stem}.json"
    for page in DOCS.glob("*.md"):
        for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name} shows {link}, which is not there"


def test_every_result_says_where_it_came_from():
    results = render.load(RESULTS)
    assert results
    for name, r in results.items():
        run, machine = r["run"], r["machine"]
        assert run["command"].split("arbor bench ", 1)[1].split()[0] in BENCHMARKS, name
        assert re.fullmatch(r"[0-9a-f]{40}", run["git_commit"]) and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", run["date"])
        assert machine["cpu"] and machine["cores"] >= 1 and machine["torch"] and isinstance(machine["isa"], list)
        for t in r["targets"]:
            assert set(t) == {"name", "value", "target", "met"}, name


def test_every_bench_has_a_result_or_a_reason():
    ran = {r["run"]["command"].split("arbor bench ", 1)[1].split()[0] for r in render.load(RESULTS).values()}
    for name in BENCHMARKS:
        if name != "render":
            assert name in ran or name in render.NOT_RERUN, f"arbor bench {name}: no result in {render.RESULTS} and no reason"
    assert all(json.dumps(why) for why in render.NOT_RERUN.values())


def test_readme_headlines_name_committed_targets():
    results = render.load(RESULTS)
    for name, target, _ in render.HEADLINES:
        assert name in results, f"HEADLINES names {name}, which has no result"
        assert target in [t["name"] for t in results[name]["targets"]], f"{name} has no target {target!r}"


def test_relative_links_of_readme_and_guides_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = link.split("#")[0]
            if path and "://" not in path:
                assert (page.parent / path).exists(), f"{page.relative_to(ROOT)} links to {link}, which is not there"


def test_figures_flatten_scalars_and_summarise_series():
    rows, omitted = render.figures({"benchmark": "x", "run": {}, "machine": {}, "targets": [],
                                    "a": {"b": 1.23456, "c": [1, 2, 3]}, "s": list(range(10)),
                                    "h": [{"k": i} for i in range(9)]})
    assert rows == [("a.b", "1.235"), ("a.c", "1, 2, 3"), ("s", "10 values: median 4.5 (0 – 9)")]
    assert omitted == [("h", 9)]


def test_the_cpu_is_named_with_its_family_and_model_numbers():
    from arbor.bench.common import _cpuinfo
    from arbor.bench.render import isa_label
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
            "flags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: other\n")
    name, flags, cpu_id = _cpuinfo(text)
    assert (name, flags, cpu_id) == ("AMD EPYC", ["fpu", "avx2", "avx512f"], "family 25 model 17")   # the first CPU's
    assert _cpuinfo("Model\t: Raspberry Pi\nFeatures\t: neon\n") == ("Raspberry Pi", ["neon"], None)
    assert isa_label({"cpu": name, "cpu_id": cpu_id, "isa": ["avx512f"]}) == "AMD EPYC family 25 model 17 (AVX-512)"
    assert isa_label({"cpu": "AMD EPYC", "isa": ["avx2"]}) == "AMD EPYC (AVX2)"        # results from before cpu_id
