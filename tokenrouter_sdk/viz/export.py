"""An executed notebook as one HTML page whose figures draw offline.

nbconvert's HTML export shows each figure's HTML form (see `tokenrouter_sdk.viz.plotlyjs`),
which loads plotly.js from plotly's CDN the first time a figure is drawn. `export_html` puts
plotly.js once in the page's head instead, so the page opens without network.

    python -m tokenrouter_sdk.viz.export notebook.ipynb page.html
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def export_html(notebook, path=None, *, plotlyjs: str = "inline", template: str = "lab") -> str:
    """Export a notebook (as saved: with its outputs) to one HTML page with nbconvert.

    Args:
        notebook: a path to an ``.ipynb`` or an ``nbformat.NotebookNode``.
        path: also write the page there (UTF-8).
        plotlyjs: ``"inline"``: plotly.js (about 4.8 MB) once in the page's head, the page opens
            offline; ``"cdn"``: the figures load it from plotly's CDN (a small page that needs
            network); any other string: the address the figures load it from.
        template: nbconvert's HTML template (``"lab"`` or ``"classic"``).

    Returns:
        the page as a string.

    Raises:
        ImportError: nbconvert (or, with ``"inline"``, plotly) is not installed.
    """
    try:
        import nbformat
        from nbconvert import HTMLExporter
    except ImportError as e:
        raise ImportError("export_html needs nbconvert: pip install nbconvert") from e
    nb = notebook if isinstance(notebook, nbformat.NotebookNode) else nbformat.read(str(notebook), as_version=4)
    page, _ = HTMLExporter(template_name=template).from_notebook_node(nb)
    if plotlyjs == "inline":
        from plotly.offline import get_plotlyjs

        head = f'<script type="text/javascript">{get_plotlyjs()}</script>'
    elif plotlyjs == "cdn":
        head = ""
    else:
        head = f'<script type="text/javascript">window.TOKENROUTER_PLOTLYJS = {json.dumps(plotlyjs)};</script>'
    if head:
        page = page.replace("</head>", head + "</head>", 1) if "</head>" in page else head + page
    if path is not None:
        Path(path).write_text(page, encoding="utf-8")
    return page


def main(argv=None) -> int:
    """``python -m tokenrouter_sdk.viz.export NOTEBOOK [PAGE]`` (default PAGE: NOTEBOOK with .html)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or len(args) > 2:
        print("usage: python -m tokenrouter_sdk.viz.export NOTEBOOK.ipynb [PAGE.html]")
        return 0 if args and args[0] in ("-h", "--help") else 2
    out = Path(args[1]) if len(args) > 1 else Path(args[0]).with_suffix(".html")
    export_html(args[0], out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, plotly.js inlined: opens offline)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
