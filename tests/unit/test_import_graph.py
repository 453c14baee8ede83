"""The package's modules import one another without a circle, and down its layers (`LAYERS`)
but for the imports `ALLOWED_UP` names: every import counts (at module level, inside functions,
and under ``TYPE_CHECKING``), so a lazy import cannot hide one."""

import ast
from pathlib import Path

import pytest

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
                base = (
                    ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module
                )
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
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")  # a lazy import
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert circles(module_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]


# The package's layers, lowest first: a module may import its own layer and the ones below.
# Each name is a top-level module or folder of the package (``engine`` is ``engine/``).
LAYERS = (
    (
        "request",
        "build_lock",
        "placement",
        "kv_sizing",
        "random_models",
        "self_draft",
        "benchmarks",
        "tables",
        "prompts",
        "byte_vocab",
    ),
    ("policy",),
    ("models", "pairs", "deferred"),
    ("policies",),
    ("engine",),
    ("metrics",),
    ("viz",),
    ("result",),
    ("backends",),
    ("planner",),
    ("reference", "reference_mixed"),
    ("runner_setup",),
    ("router",),
    ("serve",),
    ("eval",),
    ("demo",),
    ("bench",),
    ("train",),
    ("cli",),
)
# The imports that go up, each with why it stays: at most two.
ALLOWED_UP = {
    ("tokenrouter_sdk.router", "tokenrouter_sdk.serve.app"): "Router.serve(): the HTTP server on the Router's engine",
    ("tokenrouter_sdk.router", "tokenrouter_sdk.serve.server"): "Router.serve(): its background server",
}


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of a package module (None: the package's ``__init__``)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module}: its top-level name {parts[1]!r} is in no layer of LAYERS: add it")


def upward_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports from a module to one of a higher layer."""
    out = []
    for mod, targets in graph.items():
        here = layer_of(mod)
        for t in targets:
            there = layer_of(t)
            if here is not None and there is not None and there > here:
                out.append((mod, t))
    return sorted(out)


def test_imports_go_down_the_layers_but_for_at_most_two_named_edges():
    up = upward_edges(module_graph())
    assert len(ALLOWED_UP) <= 2
    assert {(a, b) for a, b in up} <= set(ALLOWED_UP), [e for e in up if e not in ALLOWED_UP]
    # counted per pair of layers: the two Router.serve imports are one edge, router -> serve
    assert len({(layer_of(a), layer_of(b)) for a, b in up}) <= 2


def test_the_layer_check_sees_an_import_that_goes_up(tmp_path):
    graph = {
        "tokenrouter_sdk.engine.front.call": {"tokenrouter_sdk.metrics"},
        "tokenrouter_sdk.metrics": {"tokenrouter_sdk.engine.messages"},
        "tokenrouter_sdk.engine.messages": set(),
    }
    assert upward_edges(graph) == [("tokenrouter_sdk.engine.front.call", "tokenrouter_sdk.metrics")]
    with pytest.raises(AssertionError, match="'mystery' is in no layer"):
        upward_edges({"tokenrouter_sdk.mystery": {"tokenrouter_sdk.engine"}, "tokenrouter_sdk.engine": set()})


ENGINE_ROOMS = (("config", "messages", "runner", "step_result"), ("core",), ("transports",), ("front",))


def engine_room_of(module: str) -> int | None:
    """The index in `ENGINE_ROOMS` of a module of ``tokenrouter_sdk.engine`` (None: elsewhere, or
    the package's ``__init__``)."""
    parts = module.split(".")
    if parts[:2] != ["tokenrouter_sdk", "engine"] or len(parts) < 3:
        return None
    for i, names in enumerate(ENGINE_ROOMS):
        if parts[2] in names:
            return i
    raise AssertionError(f"{module}: {parts[2]!r} is in no room of ENGINE_ROOMS: add it")


def test_the_engine_rooms_import_down_seam_core_transports_front():
    graph = module_graph()
    rooms = {m for m in graph if engine_room_of(m) is not None}
    assert {m.split(".")[2] for m in rooms} >= {"core", "transports", "front", "messages", "runner"}
    up = sorted(
        (a, b)
        for a in rooms
        for b in graph[a]
        if engine_room_of(b) is not None and engine_room_of(b) > engine_room_of(a)
    )
    assert up == []


def test_the_room_check_sees_an_import_that_goes_up():
    assert engine_room_of("tokenrouter_sdk.engine.core.subserver") < engine_room_of(
        "tokenrouter_sdk.engine.front.engine"
    )
    with pytest.raises(AssertionError, match="'attic' is in no room"):
        engine_room_of("tokenrouter_sdk.engine.attic.x")
