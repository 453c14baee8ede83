"""A finished run's static page (`RunResult.to_html`: coloured tokens + timeline, plotly.js
inlined) rendered in headless Chromium, offline. Asserts on the DOM after scripts ran: plotly
drew its SVG (class ``main-svg``, bars and lines inside) and the coloured token spans are there.
The screenshot is kept under ``$TOKENROUTER_ARTIFACTS`` (default: pytest's tmp dir)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import mixed_prompts
from tokenrouter_sdk import Router
from tokenrouter_sdk.policies import RandomRouting

CHROMIUM = next(
    (
        p
        for p in (
            os.environ.get("CHROMIUM"),
            shutil.which("chromium"),
            "/usr/bin/chromium",
            shutil.which("chromium-browser"),
            shutil.which("google-chrome"),
        )
        if p and Path(p).exists()
    ),
    None,
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (setup.sh installs Debian's 'chromium' when run as root; or set CHROMIUM=/path)",
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
]


def _chromium(args, profile: Path, timeout=120) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    import torch

    from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate

    torch.set_num_threads(1)
    large = tiny_model(num_layers=4, seed=1)
    with Router(
        {"small": truncate(large, 2), "large": large},
        RandomRouting(p=0.3, seed=0),
        tokenizer=tiny_tokenizer(),
        processes=False,
    ) as r:
        outs = r.generate(mixed_prompts(3), max_new_tokens=16, ignore_eos=True)
    path = tmp_path_factory.mktemp("page") / "run.html"
    outs.to_html(path, title="browser check")
    return path, outs


def test_static_page_renders_in_chromium(page, tmp_path):
    path, outs = page
    art = Path(os.environ.get("TOKENROUTER_ARTIFACTS") or tmp_path)
    art.mkdir(parents=True, exist_ok=True)
    url = path.as_uri()
    dom = _chromium(["--virtual-time-budget=15000", "--dump-dom", url], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    # plotly ran offline and drew the figure: its SVG root, the bars and the step lines
    assert 'class="main-svg"' in html, "plotly did not render (no main-svg): " + dom.stderr[-1500:]
    assert len(re.findall(r'class="point"', html)) >= sum(o.hops + 1 for o in outs)  # one bar per owner segment
    assert 'class="scatterlayer' in html and 'class="js-line"' in html
    # the coloured tokens: one span per committed token, coloured by its model
    spans = re.findall(r'<span class="tr-tok" data-model="(\w+)"', html)
    assert spans == [m for o in outs for m in o.token_models]
    assert "browser check" in html
    shot = art / "run_page.png"
    res = _chromium(
        ["--virtual-time-budget=15000", "--window-size=1200,1400", f"--screenshot={shot}", url],
        tmp_path / "profile-shot",
    )
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    assert shot.stat().st_size > 20_000  # a real picture, not a blank page
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
