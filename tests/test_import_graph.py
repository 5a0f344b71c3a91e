"""The import graph of the product packages, read from their source with ``ast`` (imports
inside functions included, relative imports resolved): calibration and sglang_ext stand
side by side on oscar_kernels, only sglang_ext imports sglang, and no module imports itself
through a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("calibration", "oscar_kernels", "sglang_ext")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under the packages."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute dotted names that ``module``'s source imports, anywhere in the file; for
    ``from X import y`` both X and X.y (y may be a submodule)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                if node.level - 1 >= len(base):
                    raise ValueError(f"{module}: relative import beyond the top-level package")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            names.add(origin)
            names.update(f"{origin}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def import_graph(root: Path, packages=PACKAGES) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(internal, external): for each module of ``packages``, the modules of those packages it
    imports (each name resolved to the longest module it names) and the top-level names of
    everything else it imports."""
    mods = module_files(root, packages)
    internal, external = {}, {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imported = _imported_names(tree, name, path.name == "__init__.py")
        internal[name], external[name] = set(), set()
        for dotted in imported:
            parts = dotted.split(".")
            target = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods),
                          None)
            if target is None:
                external[name].add(parts[0])
            elif target != name:
                internal[name].add(target)
    return internal, external


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _package(module: str) -> str:
    return module.split(".")[0]


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_no_import_cycles(graph):
    internal, _ = graph
    assert cycles(internal) == []


def test_sglang_ext_imports_nothing_from_calibration(graph):
    internal, _ = graph
    bad = {m: sorted(t for t in ts if _package(t) == "calibration")
           for m, ts in internal.items() if _package(m) == "sglang_ext"}
    assert {m: ts for m, ts in bad.items() if ts} == {}


@pytest.mark.parametrize("package", ["calibration", "oscar_kernels"])
def test_only_sglang_ext_imports_sglang(graph, package):
    internal, external = graph
    bad = {m: sorted({t for t in external[m] if t == "sglang"}
                     | {t for t in internal[m] if _package(t) == "sglang_ext"})
           for m in internal if _package(m) == package}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_oscar_kernels_imports_neither_calibration_nor_sglang_ext(graph):
    internal, _ = graph
    bad = {m: sorted(t for t in ts if _package(t) != "oscar_kernels")
           for m, ts in internal.items() if _package(m) == "oscar_kernels"}
    assert {m: ts for m, ts in bad.items() if ts} == {}


# ---------------------------------------------------------------- the reader itself

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_reader_resolves_relative_and_function_level_imports(tmp_path):
    root = _tree(tmp_path, {
        "pa/__init__.py": "from . import a\n",
        "pa/a.py": "import os\nfrom .sub import b\n",
        "pa/sub/__init__.py": "",
        "pa/sub/b.py": "def f():\n    from ..a import x\n    from pb.c import y\n    import sglang.srt\n",
        "pb/__init__.py": "",
        "pb/c.py": "from pa.sub import b as _\nfrom . import missing_name\n",
    })
    internal, external = import_graph(root, ("pa", "pb"))
    assert internal == {"pa": {"pa.a"}, "pa.a": {"pa.sub", "pa.sub.b"}, "pa.sub": set(),
                        "pa.sub.b": {"pa.a", "pb.c"}, "pb": set(), "pb.c": {"pa.sub", "pa.sub.b", "pb"}}
    assert external["pa.a"] == {"os"} and external["pa.sub.b"] == {"sglang"}
    assert cycles(internal) == [["pa.a", "pa.sub.b", "pb.c"]]


def test_reader_refuses_a_relative_import_beyond_the_top(tmp_path):
    root = _tree(tmp_path, {"pa/__init__.py": "", "pa/a.py": "from .. import x\n"})
    with pytest.raises(ValueError, match="beyond the top-level package"):
        import_graph(root, ("pa",))
