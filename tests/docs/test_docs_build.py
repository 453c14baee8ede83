"""The documentation site builds with ``mkdocs build --strict`` (any warning fails: broken links,
bad docstrings under mkdocstrings, notebooks mkdocs-jupyter cannot render)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs_jupyter", reason="docs extras missing: pip install mkdocs-material mkdocstrings[python] "
                                                 "mkdocs-jupyter")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # the API reference was generated from docstrings, the tutorials and pages were rendered
    router_page = (site / "api" / "router" / "index.html").read_text(encoding="utf-8")
    assert "Token-level routing over several models" in router_page and "generate" in router_page
    assert "live" in router_page
    viz_page = (site / "api" / "viz" / "index.html").read_text(encoding="utf-8")
    assert "RunResult" in viz_page and "LiveView" in viz_page
    for nb in sorted((ROOT / "tutorials").glob("*.ipynb")):
        page = site / "tutorials" / nb.stem / "index.html"
        assert page.exists(), f"tutorial {nb.name} was not rendered"
        assert "parameters" in page.read_text(encoding="utf-8")
    for name in ("architecture", "metrics", "views"):
        assert (site / name / "index.html").exists()
