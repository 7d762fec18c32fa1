"""The dependency rule of ARCHITECTURE.md, read from the source with ``ast``.

Every import (module level or inside a function) from one Arbor package to another points down the
stack ``LAYERS`` (top first): a package imports only packages below it, never one above it or a
peer, and the module import graph has no cycles. No library file is longer than 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "arbor"

LAYERS = ["cli", "bench", "cluster", "dllm", "train", "tasks", "rollout", "data", "plan", "serve", "engine",
          "models", "distributed", "kernels", "configs"]
ENTRY = {"cli", "__main__", "families"}      # the command line and its model-family registry: top layer
MAX_LINES = 400


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT, typing_only: bool = True) -> set[str]:
    """Absolute names of the ``arbor`` modules ``path`` imports (relative imports resolved);
    ``typing_only=False`` leaves out those under ``if TYPE_CHECKING:`` (never run)."""
    mod = module_name(path, root)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    skip = set()
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            target = ".".join(x for x in (base, node.module) if x)
            names = [f"{target}.{a.name}" for a in node.names]
            out.update(n if module_path(n, root) else target for n in names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {n for n in out if n == "arbor" or n.startswith("arbor.")}


def module_path(name: str, root: Path = ROOT) -> Path | None:
    p = root.parent.joinpath(*name.split("."))
    for cand in (p.with_suffix(".py"), p / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def package(name: str) -> str:
    """The layer name of module ``name``: its package under ``arbor`` (the entry modules count as cli)."""
    parts = name.split(".")
    if len(parts) == 1:
        return ""                              # the root package: a version string, below everything
    return "cli" if parts[1] in ENTRY else parts[1]


def layer(name: str) -> int:
    top = package(name)
    if not top:
        return len(LAYERS)
    assert top in LAYERS, f"package arbor.{parts[1]} has no place in LAYERS (add it to ARCHITECTURE.md and here)"
    return LAYERS.index(top)


def graph(root: Path = ROOT, typing_only: bool = True) -> dict[str, set[str]]:
    return {module_name(p, root): imports(p, root, typing_only) for p in root.rglob("*.py")}


def upward_imports(root: Path = ROOT) -> list[str]:
    wrong = []
    for mod, targets in graph(root).items():
        for t in targets:
            if package(mod) != package(t) and layer(t) <= layer(mod):
                wrong.append(f"{mod} imports {t}")
    return sorted(wrong)


def test_imports_point_down_the_layers():
    wrong = upward_imports()
    assert not wrong, "imports against the dependency rule of ARCHITECTURE.md:\n" + "\n".join(wrong)


def test_no_import_cycles():
    """Imports that run (module level or in a function; not those for type checkers only)."""
    g = {m: {t for t in ts if t != m and module_path(t)} for m, ts in graph(typing_only=False).items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_files_stay_small():
    long = [f"{p.relative_to(ROOT.parent)}: {n} lines" for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines (split them by responsibility):\n" + "\n".join(long)


def test_rule_catches_an_upward_import(tmp_path):
    """The checker itself: an engine module importing train (in a function) is reported; models
    importing kernels is not."""
    root = tmp_path / "arbor"
    for pkg in ("engine", "train", "models", "kernels"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "train" / "loop.py").write_text("")
    (root / "kernels" / "native.py").write_text("")
    (root / "engine" / "x.py").write_text("def f():\n    from arbor.train import loop\n")
    (root / "models" / "y.py").write_text("from arbor.kernels.native import build\n")
    assert upward_imports(root) == ["arbor.engine.x imports arbor.train.loop"]
