"""Execute the tutorials top to bottom in a real Jupyter kernel (where an event loop runs)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.integration

TUTORIALS = sorted((Path(__file__).resolve().parents[2] / "tutorials").glob("*.ipynb"))


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # shorten the run: the parameters cell
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            cell.source = cell.source.replace("MAX_NEW_TOKENS = 48", "MAX_NEW_TOKENS = 12")
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "throughput_tok_s" in outputs and "hop rate" in outputs and "[" in outputs
