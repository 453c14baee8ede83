"""The tutorials as the tests and the docs run them.

- `shortened` / `executed`: a tutorial with CI's short parameters (a cell with `SHORT[name]`
  inserted right after the cell tagged ``parameters``, papermill's convention), executed once per
  test session in a real kernel and shared by the tests that need it.
- ``python -m tests.notebooks.tutorials [NAME ...]``: execute the tutorials with their own
  parameters and save them with their outputs (what the docs site shows; mkdocs-jupyter does not
  execute). The saved notebook records the SHA-256 of its cells' sources in its metadata, so a
  test finds a tutorial edited without being re-run.

``TOKENROUTER_TUTORIAL_SMALL_LAYERS=k`` also sets ``SMALL_LAYERS = k`` in the short runs (the
plain k-layer truncation instead of the packaged small model).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted((ROOT / "tutorials").glob("*.ipynb"))
MAX_BYTES = 2_000_000  # a tutorial saved with its outputs stays under this

SHORT = {
    "01_quickstart": "MAX_NEW_TOKENS = 12",
    "02_write_a_policy": "MAX_NEW_TOKENS = 12\nN_PROMPTS = 2",
    "03_quality_at_hop_rate": "LIMIT = 2\nVALUES = [0.05]\nMAX_NEW_TOKENS = 16\nREFERENCES = ['large_only']",
    "04_scheduling": "N_REQUESTS = 4\nMAX_NEW_TOKENS = 8\nPROFILE = dict(steps=1, warmup=0, context=8)\n"
    "MODES = ['async', 'delayed']",
}


def path_of(name: str) -> Path:
    return ROOT / "tutorials" / f"{name}.ipynb"


def source_sha256(nb) -> str:
    """SHA-256 over the cell types and sources, in order (outputs and metadata excluded)."""
    h = hashlib.sha256()
    for c in nb.cells:
        h.update(c.cell_type.encode() + b"\0" + c.source.encode() + b"\0")
    return h.hexdigest()


def shortened(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    idx = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(idx) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
    src = SHORT.get(path.stem, "")
    if os.environ.get("TOKENROUTER_TUTORIAL_SMALL_LAYERS"):
        src += f"\nSMALL_LAYERS = {int(os.environ['TOKENROUTER_TUTORIAL_SMALL_LAYERS'])}"
    nb.cells.insert(idx[0] + 1, nbformat.v4.new_code_cell(f"# injected by tests/notebooks\n{src}"))
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    return nb


def _run(nb, folder: Path, store_widget_state: bool = True) -> None:
    # no progress bars (tqdm widgets of weight loading) in the outputs
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        store_widget_state=store_widget_state,
        resources={"metadata": {"path": str(folder)}},
    ).execute(env=env)


@functools.lru_cache(maxsize=None)
def _executed(name: str) -> nbformat.NotebookNode:
    nb = shortened(path_of(name))
    _run(nb, path_of(name).parent)
    return nb


def executed(name: str) -> nbformat.NotebookNode:
    """Tutorial ``name`` with the short parameters, executed once per session (a copy)."""
    return copy.deepcopy(_executed(name))


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


def render(name: str) -> Path:
    """Execute tutorial ``name`` with its own parameters and save it with its outputs (no widget
    state: the live view collapses into static outputs); returns its path."""
    path = path_of(name)
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    _run(nb, path.parent, store_widget_state=False)
    nb.metadata.pop("widgets", None)
    nb.metadata["tokenrouter"] = {"source_sha256": source_sha256(nb)}
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    names = sys.argv[1:] or [p.stem for p in TUTORIALS]
    for n in names:
        p = render(n)
        size = p.stat().st_size
        print(f"{p.relative_to(ROOT)}: {size / 1e6:.2f} MB" + ("" if size < MAX_BYTES else "  (too big)"), flush=True)
