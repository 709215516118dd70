"""The repository's own import graph (issue 51): no import circle anywhere, and megatron_contract, the
leaf both the operator and the trainer import, imports the standard library only.

Read from the source with ``ast``, nothing imported: every ``import`` and ``from ... import``, at
module level or inside a function (a lazy import is a dependency too; it is how circles hide).
Packages live under pyproject.toml's source roots; the scripts directories (bench/, e2e/, e2e/gpu/,
scripts/, tests/) hold flat modules that put their own directory, and others, on ``sys.path``. A
flat import is resolved in the importer's directory first, then in the one other directory that has
the name. import-linter (pyproject.toml) checks the packages' layers; it does not see the flat
modules. Not seen: an import by a computed name (``importlib.import_module(name)``), which is how
e2e/gpu/suite.py loads its optional families; hence the rule that nothing there imports suite.py.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: pyproject.toml's source roots (directories of packages).
PACKAGE_ROOTS = ("operator", "trainer_image", "contract")
#: Directories of flat modules (scripts, the GPU suite, tests and their helpers).
FLAT_DIRS = ("bench", "e2e", "e2e/cluster", "e2e/gpu", "e2e/gpu/stepdump_site", "scripts", "tests", "tests/unit",
             "tests/trainer")


def modules(root: Path, package_roots: Iterable[str], flat_dirs: Iterable[str]) -> dict[str, Path]:
    """Module name -> file. Packages by dotted name; flat modules as ``<directory>/<stem>``."""
    out: dict[str, Path] = {}
    for pr in package_roots:
        for path in sorted((root / pr).rglob("*.py")):
            parts = path.relative_to(root / pr).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for d in flat_dirs:
        for path in sorted((root / d).glob("*.py")):
            out[f"{d}/{path.stem}"] = path
    return out


def _package_target(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our packages' modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def _flat_target(importer: str, name: str, known: dict[str, Path]) -> str | None:
    top = name.split(".")[0]
    own = f"{importer.rsplit('/', 1)[0]}/{top}" if "/" in importer else None
    if own in known:
        return own
    others = [m for m in known if "/" in m and m.rsplit("/", 1)[1] == top]
    return others[0] if len(others) == 1 else None


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module`` imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()

    def target(name: str) -> None:
        found = _package_target(name, known) or _flat_target(module, name, known)
        if found is not None and found != module:
            out.add(found)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: only inside packages
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{name}.{alias.name}"
                target(sub if sub in known else name)
    return out


def graph(root: Path, package_roots: Iterable[str], flat_dirs: Iterable[str]) -> dict[str, set[str]]:
    known = modules(root, package_roots, flat_dirs)
    return {m: imports(m, p, known) for m, p in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as one circle through it:
    ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle_through(c, edges) for c in components]


def _circle_through(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, inside = component[0], set(component)
    paths = {w: [start, w] for w in sorted(edges[start] & inside)}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & inside):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return paths[start]


def test_the_circle_finder_finds_a_circle_through_a_lazy_and_a_relative_import(tmp_path):
    """The check itself can fail: a package circle through a relative import inside a function, and a
    flat one between two scripts; a plain chain is no circle."""
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from pkg.a import x\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "one.py").write_text("import two\n")
    (tmp_path / "tools" / "two.py").write_text("from one import x\nimport json\n")
    (tmp_path / "tools" / "three.py").write_text("import one\n")
    found = circles(graph(tmp_path, ["src"], ["tools"]))
    assert found == [["pkg.a", "pkg.b", "pkg.a"], ["tools/one", "tools/two", "tools/one"]]


def test_the_graph_sees_the_repositorys_imports():
    """The resolution works on this repository: a relative, an absolute, a lazy and a flat import."""
    edges = graph(ROOT, PACKAGE_ROOTS, FLAT_DIRS)
    assert "megatron_contract.hf_config" in edges["megatron_operator.hf_config"]
    assert "megatron_trainer.hf_config" in edges["megatron_trainer.hf_source"]
    assert "megatron_operator.hf_config" in edges["megatron_operator.cli"]  # inside cmd_hf_config
    assert "bench/crd_variants" in edges["bench/operator_latency"]
    assert "e2e/mjob" in edges["bench/crd_variants"]
    assert "tests/unit/test_hf_config" in edges["tests/test_contract"]
    assert "e2e/gpu/harness" in edges["e2e/gpu/hf"]


def test_no_import_circle_in_the_repository():
    found = circles(graph(ROOT, PACKAGE_ROOTS, FLAT_DIRS))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_nothing_in_the_gpu_suite_imports_its_registry():
    """e2e/gpu/suite.py is the registry and CLI: it imports the scenario families (hf and sft by name,
    which the graph cannot see), so a family importing it back would be a circle the check misses.
    Before the split, hf.py, sft.py and stepdump.py imported suite.py."""
    edges = graph(ROOT, PACKAGE_ROOTS, FLAT_DIRS)
    importers = sorted(m for m, targets in edges.items() if m.startswith("e2e/gpu/") and "e2e/gpu/suite" in targets)
    assert not importers


def test_megatron_contract_imports_the_standard_library_only():
    """Both the operator's and the trainer's images install it; it may carry no dependency of either."""
    bad = []
    for path in sorted((ROOT / "contract").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.split(".")[0] not in sys.stdlib_module_names | {"__future__", "megatron_contract"}]
    assert not bad, bad
