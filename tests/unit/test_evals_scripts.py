"""Every script in evals/ answers ``--help`` without loading a model, and documents itself: a
docstring that says how to run it (its own path after ``Run:``) and the suite's ``--out DIR``.

All scripts run in one subprocess (one interpreter start, one torch import), each through
``runpy`` with ``argv = [script, "--help"]``; model loaders are replaced by functions that raise,
so a script that builds a model before parsing its arguments fails here."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "evals").glob("*/*.py"))

DRIVER = r"""
import contextlib, io, json, runpy, sys
import tokenrouter_sdk.models as models
import tokenrouter_sdk.random_models as random_models

def refuse(*a, **k):
    raise RuntimeError("a model was loaded during --help")

for mod, names in ((models, ("default_pair", "load_model", "tiny_model")), (random_models, ("random_model",))):
    for name in names:
        setattr(mod, name, refuse)
results = {}
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [path, "--help"]
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    results[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps():
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, SCRIPTS)], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_suite_has_its_groups():
    groups = {p.parent.name for p in SCRIPTS}
    assert groups == {"throughput", "quality", "planner", "investigations"}, groups
    assert len(SCRIPTS) >= 15


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help_runs_without_loading_a_model(helps, script):
    r = helps[str(script)]
    assert r["code"] in (0, None), (r["code"], r["stderr"][-2000:])
    usage = r["stdout"]
    assert usage.startswith(f"usage: evals/{script.parent.name}/{script.name}"), usage[:200]
    assert "--out OUT" in usage, "every script takes --out DIR (evals/evalkit.py)"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_docstring_says_what_and_how(script):
    doc = ast.get_docstring(ast.parse(script.read_text()))
    assert doc and len(doc.split()) >= 20, "the docstring says what the script measures"
    run = doc.split("Run:", 1)
    assert len(run) == 2 and f"evals/{script.parent.name}/{script.name}" in run[1], (
        "the docstring says how to run it: 'Run:' then the command"
    )
    assert "Writes" in doc, "the docstring names the files it writes"
