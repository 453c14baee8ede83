"""Execute every tutorial top to bottom in a real Jupyter kernel (where an event loop runs), with
shortened parameters: CI fails on any cell error.

Shortening: right after the cell tagged ``parameters`` a cell with `SHORT[notebook]` is inserted
(papermill's convention). ``TOKENROUTER_TUTORIAL_SMALL_LAYERS=k`` also sets ``SMALL_LAYERS = k``
(the plain k-layer truncation instead of the packaged small model, e.g. on a checkout without it).
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.integration

TUTORIALS = sorted((Path(__file__).resolve().parents[2] / "tutorials").glob("*.ipynb"))

SHORT = {
    "01_quickstart": "MAX_NEW_TOKENS = 12",
    "02_write_a_policy": "MAX_NEW_TOKENS = 12\nN_PROMPTS = 2",
    "03_quality_at_hop_rate": "LIMIT = 2\nVALUES = [0.1]\nMAX_NEW_TOKENS = 16\nREFERENCES = ['large_only']",
    "04_scheduling": "N_REQUESTS = 4\nMAX_NEW_TOKENS = 8\nPROFILE = dict(steps=1, warmup=0, context=8)\nMODES = ['async', 'delayed']",
}

# what each notebook must have shown (mime type or text), beyond running without errors
EXPECT = {
    "01_quickstart": ["throughput_tok_s", "hop rate", "application/vnd.jupyter.widget-view+json",
                      'class="tr-tok"', "application/vnd.plotly.v1+json"],
    "02_write_a_policy": ["BudgetedStitch(tau=", 'class="tr-tok"', "application/vnd.plotly.v1+json"],
    "03_quality_at_hop_rate": ["large_only", "application/vnd.plotly.v1+json"],
    "04_scheduling": ["of tokens equal to", "delayed", "application/vnd.plotly.v1+json"],
}


def shortened(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    idx = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(idx) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
    src = SHORT.get(path.stem, "")
    if os.environ.get("TOKENROUTER_TUTORIAL_SMALL_LAYERS"):
        src += f"\nSMALL_LAYERS = {int(os.environ['TOKENROUTER_TUTORIAL_SMALL_LAYERS'])}"
    nb.cells.insert(idx[0] + 1, nbformat.v4.new_code_cell(f"# injected by tests/notebooks\n{src}"))
    return nb


def shown(nb) -> str:
    """Everything the notebook displayed, as one string (text, mime types, HTML)."""
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            parts.append(o.get("text", ""))
            for mime, val in o.get("data", {}).items():
                parts.append(mime)
                parts.append(val if isinstance(val, str) else "")
    return "\n".join(parts)


def test_every_tutorial_is_tested():
    assert {p.stem for p in TUTORIALS} == set(SHORT) == set(EXPECT)


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path):
    nb = shortened(path)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    out = shown(nb)
    missing = [e for e in EXPECT[path.stem] if e not in out]
    assert not missing, f"{path.name} did not show {missing}"
