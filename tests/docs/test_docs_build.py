"""The documentation site builds with ``mkdocs build --strict`` (any warning fails: broken links,
bad docstrings under mkdocstrings, notebooks mkdocs-jupyter cannot render), and its tutorial
pages show results: the tutorials are stored with their outputs (mkdocs-jupyter does not execute
them), so the pages hold the coloured answers and the figures' HTML forms."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip(
        "mkdocs_jupyter", reason="docs extras missing: pip install mkdocs-material mkdocstrings[python] mkdocs-jupyter"
    )
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # the API reference was generated from docstrings, the tutorials and pages were rendered
    router_page = (site / "api" / "router" / "index.html").read_text(encoding="utf-8")
    assert "Token-level routing over several models" in router_page and "generate" in router_page
    assert "live" in router_page
    viz_page = (site / "api" / "viz" / "index.html").read_text(encoding="utf-8")
    assert "RunResult" in viz_page and "LiveView" in viz_page
    figures = {}
    for nb in sorted((ROOT / "tutorials").glob("*.ipynb")):
        page = site / "tutorials" / nb.stem / "index.html"
        assert page.exists(), f"tutorial {nb.name} was not rendered"
        text = page.read_text(encoding="utf-8")
        assert "parameters" in text
        # each figure: its div and the script that draws it once plotly.js is on the page
        figures[nb.stem] = len(
            [d for d in re.findall(r'<div [^>]*id="tr-fig-[0-9a-f]+"[^>]*>', text) if 'class="tr-plotly"' in d]
        )
        assert figures[nb.stem] == text.count("window.Plotly.newPlot(el,spec.data") >= 1, nb.stem
        assert "application/vnd.jupyter.widget-view+json" not in text
    quick = (site / "tutorials" / "01_quickstart" / "index.html").read_text(encoding="utf-8")
    spans = re.findall(r'<span class="tr-tok" data-model="(small|large)"[^>]*style="background:(#[0-9a-f]{6})"', quick)
    assert len(spans) > 100 and {m for m, _ in spans} == {"small", "large"}  # both models wrote, in colour
    assert len({c for _, c in spans}) == 2  # one colour per model
    assert len(re.findall(r"<table class=[\"']tr-table[\"']", quick)) >= 4  # Metrics, RunResult, KV stats
    assert figures["01_quickstart"] >= 2 and figures["03_quality_at_hop_rate"] >= 2
    assert 'class="tr-tok"' in (site / "tutorials" / "02_write_a_policy" / "index.html").read_text(encoding="utf-8")
    assert (site / "img" / "tutorial_01_export.png").stat().st_size > 100_000
    for name in ("architecture", "metrics", "views"):
        assert (site / name / "index.html").exists()
