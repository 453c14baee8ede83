"""`NotebookFigure`: the plotly figure the SDK returns (imports plotly; imported when a figure
is drawn)."""

from __future__ import annotations

import plotly.graph_objects as go

from .plotlyjs import figure_bundle


class NotebookFigure(go.Figure):
    """A ``plotly.graph_objects.Figure`` whose notebook output survives export: plotly's JSON
    (drawn by JupyterLab / VS Code) together with an HTML form (drawn by nbconvert's HTML and the
    docs site, plotly.js loaded once per page); see `tokenrouter_sdk.viz.plotlyjs`. Everything
    else is plotly's ``Figure`` (``update_layout``, ``write_html``, ``show``, pickling)."""

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        return figure_bundle(self)

    def _repr_html_(self) -> str:
        return figure_bundle(self)["text/html"]

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(figure_bundle(self), raw=True)
