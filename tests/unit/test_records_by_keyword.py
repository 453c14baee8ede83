"""Wide records (`StepDone`, 15 fields; `RequestView`, 9) are built by keyword everywhere: a
positional construction silently shifts a value into another field when a field is added."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WIDE = {"StepDone", "RequestView"}
PENDING: set[tuple[str, str]] = set()  # (file, function) of constructions still positional


def positional_constructions(path: Path) -> list[tuple[int, str, str | None]]:
    found = []

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call) and child.args:
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name in WIDE:
                    found.append((child.lineno, name, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), None)
    return found


def sources():
    for folder in ("tokenrouter_sdk", "tests", "evals"):
        yield from sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("kind", ["package", "tests and evals"])
def test_wide_records_are_built_by_keyword(kind):
    bad = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        if (kind == "package") != rel.startswith("tokenrouter_sdk/"):
            continue
        bad += [
            f"{rel}:{line} {name} in {fn}"
            for line, name, fn in positional_constructions(path)
            if (rel, fn) not in PENDING
        ]
    assert not bad, "build these records by keyword:\n" + "\n".join(bad)
