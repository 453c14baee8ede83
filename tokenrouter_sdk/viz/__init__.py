"""Views of routed generation: what a finished run and a running one look like.

- What `tokenrouter_sdk.result.RunResult` (``Router.generate``'s list of `RequestOutput`)
  draws: ``show()`` (coloured tokens as HTML), ``timeline()`` (plotly figure) and
  ``to_html()`` (one offline page); `RunResult` itself lives in `tokenrouter_sdk.result`, which
  uses this package.
- `LiveView`: the live hop view of ``Router.generate(..., live=True)`` (ipywidgets + plotly
  ``FigureWidget`` in a notebook; a tqdm bar and a text summary elsewhere).
- `TraceState`: the incremental reading of the event trace both share.

Importing this package imports neither plotly nor ipywidgets; the views do when drawn.
"""

from .htmlview import HTMLView
from .live import LiveView, in_notebook
from .trace import TraceState

__all__ = ["HTMLView", "LiveView", "TraceState", "in_notebook"]
