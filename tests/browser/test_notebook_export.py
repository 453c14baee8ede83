"""Tutorial 01 exported to HTML (nbconvert, through `tokenrouter_sdk.viz.export.export_html`:
plotly.js inlined once in the head) and opened in headless Chromium, offline: the live view's
static answers and ``show()`` are coloured token spans, and plotly drew the timelines.

Two notebooks: the stored tutorial (the outputs of a full run that the docs show; costs only the
browser) with a screenshot kept under ``$TOKENROUTER_ARTIFACTS`` (default: pytest's tmp dir),
and the tutorial executed now with the short parameters (shared with tests/notebooks)."""

import os
import re
from pathlib import Path

import nbformat
import pytest

from tests.browser.test_static_html import CHROMIUM, _chromium
from tests.notebooks.tutorials import executed, path_of
from tokenrouter_sdk.viz.export import export_html

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (setup.sh installs Debian's 'chromium' when run as root; or set CHROMIUM=/path)",
)


def _tokens(nb) -> int:
    """Coloured token spans the notebook's HTML outputs hold."""
    return sum(
        o.get("data", {}).get("text/html", "").count('<span class="tr-tok"')
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )


def _figures(nb) -> int:
    return sum(
        "application/vnd.plotly.v1+json" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )


def _check_dom(dom: str, nb) -> None:
    # plotly ran offline and drew every figure into its div (the plot container inside it), with
    # bars and step lines
    drawn = len(re.findall(r'id="tr-fig-[0-9a-f]+"[^>]*>\s*<div class="plot-container', dom))
    assert drawn == _figures(nb) >= 2, (drawn, _figures(nb))
    assert 'class="main-svg"' in dom and 'class="scatterlayer' in dom and 'class="js-line"' in dom
    assert ">plotly.js could not be loaded" not in dom  # the loader's message in a figure's div
    # the coloured tokens, each on its model's colour
    spans = re.findall(r'<span class="tr-tok" data-model="(\w+)"[^>]*style="background:(#[0-9a-f]{6})"', dom)
    assert len(spans) == _tokens(nb) > 0 and {m for m, _ in spans} <= {"small", "large"}
    assert len({c for _m, c in spans}) == len({m for m, _ in spans})


def _export_and_open(nb, folder: Path, name: str, shot: Path | None = None) -> str:
    page = folder / f"{name}.html"
    export_html(nb, page)
    dom = _chromium(["--virtual-time-budget=20000", "--dump-dom", page.as_uri()], folder / f"profile-{name}")
    assert dom.returncode == 0, dom.stderr[-2000:]
    if shot is not None:
        res = _chromium(
            ["--virtual-time-budget=20000", "--window-size=1200,5200", f"--screenshot={shot}", page.as_uri()],
            folder / f"profile-{name}-shot",
        )
        assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    return dom.stdout


def test_stored_tutorial_01_export_renders_offline(tmp_path):
    nb = nbformat.read(path_of("01_quickstart"), as_version=4)
    art = Path(os.environ.get("TOKENROUTER_ARTIFACTS") or tmp_path)
    art.mkdir(parents=True, exist_ok=True)
    shot = art / "tutorial_01_export.png"
    dom = _export_and_open(nb, tmp_path, "stored", shot)
    _check_dom(dom, nb)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 100_000  # a real page, not a blank one
    print(
        f"\nscreenshot of the exported tutorial 01: {shot} ({len(png) / 1e3:.0f} kB); notebook "
        f"{path_of('01_quickstart').stat().st_size / 1e3:.0f} kB"
    )


@pytest.mark.integration
def test_executed_tutorial_01_export_renders_offline(tmp_path):
    nb = executed("01_quickstart")
    size = len(nbformat.writes(nb).encode())
    dom = _export_and_open(nb, tmp_path, "executed")
    _check_dom(dom, nb)
    print(f"\nexecuted tutorial 01 (short parameters): {size / 1e3:.0f} kB as .ipynb")
    assert size < 2_000_000
