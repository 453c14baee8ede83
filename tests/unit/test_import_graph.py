"""The package's modules import one another without a circle: every import counts (at module
level, inside functions, and under ``TYPE_CHECKING``), so a lazy import cannot hide one."""

import ast
from pathlib import Path

import tokenrouter_sdk

ROOT = Path(tokenrouter_sdk.__file__).parent


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module name -> the package modules it imports (``a.b`` for ``a/b.py`` or ``a/b/__init__.py``)."""
    files = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {m: set() for m in files}
    for mod, f in files.items():
        here = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    if target in files and target != mod:
                        graph[mod].add(target)
            elif isinstance(node, ast.Import):
                graph[mod].update(a.name for a in node.names if a.name in files and a.name != mod)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circle():
    graph = module_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the scan sees the package
    assert circles(graph) == []


def test_the_check_finds_a_circle_when_there_is_one(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")          # a lazy import
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert circles(module_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
