"""Views of routed generation: what a finished run and a running one look like.

- `RunResult`: what ``Router.generate`` returns for a list of prompts (a list of
  `RequestOutput`) with ``show()`` (coloured tokens as HTML), ``timeline()`` (plotly figure)
  and ``to_html()`` (one offline page).
- `LiveView`: the live hop view of ``Router.generate(..., live=True)`` (ipywidgets + plotly
  ``FigureWidget`` in a notebook; a tqdm bar and a text summary elsewhere).
- `TraceState`: the incremental reading of the event trace both share.

Importing this package imports neither plotly nor ipywidgets; the views do when drawn.
"""

from .live import LiveView, in_notebook
from ..result import RunResult
from .htmlview import HTMLView
from .trace import TraceState

__all__ = ["RunResult", "HTMLView", "LiveView", "TraceState", "in_notebook"]
