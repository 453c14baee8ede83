"""Every tutorial runs top to bottom in a real Jupyter kernel (where an event loop runs), with
shortened parameters: CI fails on any cell error. The tutorials are also stored with the
outputs of a full run (the docs site shows them): those must be current (same cell sources as
the file), complete (every code cell ran, no error), show what the SDK draws (coloured tokens,
figures with an HTML form, tables) and stay small.

Re-render the stored outputs after editing a tutorial: ``python -m tests.notebooks.tutorials``.
See `tests.notebooks.tutorials` for the shortening.
"""

import json

import nbformat
import pytest

from .tutorials import MAX_BYTES, SHORT, TUTORIALS, executed, shown, source_sha256

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"

# what each notebook must have shown (mime type or text), beyond running without errors
EXPECT = {
    "01_quickstart": [
        "throughput_tok_s",
        "hop rate",
        'class="tr-tok"',
        PLOTLY,
        "Plotly.newPlot",
        "<table class='tr-table'>",
        "KV pools",
        "RunResult",
    ],
    "02_write_a_policy": ["BudgetedStitch(tau=", 'class="tr-tok"', PLOTLY, "Plotly.newPlot"],
    "03_quality_at_hop_rate": ["large_only", PLOTLY, "Plotly.newPlot"],
    "04_scheduling": ["of tokens equal to", "delayed", PLOTLY, "Plotly.newPlot"],
}


def test_every_tutorial_is_tested():
    assert {p.stem for p in TUTORIALS} == set(SHORT) == set(EXPECT)


@pytest.mark.integration
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path):
    nb = executed(path.stem)
    out = shown(nb)
    missing = [e for e in EXPECT[path.stem] if e not in out]
    assert not missing, f"{path.name} did not show {missing}"
    # a live view leaves static outputs, not widgets that need the kernel's state
    assert WIDGET_VIEW not in out


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_stored_outputs_are_current_complete_and_small(path):
    size = path.stat().st_size
    assert size < MAX_BYTES, f"{path.name} is {size / 1e6:.2f} MB"
    nb = nbformat.read(path, as_version=4)
    stamp = nb.metadata.get("tokenrouter", {}).get("source_sha256")
    assert stamp == source_sha256(nb), (
        f"{path.name} was edited after its outputs were made: run python -m tests.notebooks.tutorials {path.stem}"
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{path.name}: a cell was not run"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    out = shown(nb)
    missing = [e for e in EXPECT[path.stem] if e not in out]
    assert not missing, f"{path.name}'s stored outputs do not show {missing}"
    assert WIDGET_VIEW not in out and "widgets" not in nb.metadata
    assert "plotly.js v" not in json.dumps(nb.cells)  # figures load plotly.js, never embed it
