"""Plotly figures of a run: the per-request timeline and the per-model batch / queue series.

`timeline_figure` builds the figure with a fixed trace order; `figure_data` computes the data
of each trace from a `TraceState`, so the live view updates a ``FigureWidget`` in place with
the same function that draws a finished run.

Rows: (1) one bar row per request: a full-height bar in the colour of the model that owns
(writes) it, and under it a thin bar for each model where it is pending (handed off, KV kept);
(2) per model, the batch size of each step (solid steps) and the queue length (dotted: requests
it owns that were not in the step). x: seconds since the first admission.
"""

from __future__ import annotations

import numpy as np

from .tokens import model_color
from .trace import TraceState


def figure_data(state: TraceState, now: float | None = None) -> list[dict]:
    """Per-trace data, in the order of `timeline_figure`'s traces: for each model an ownership
    bar trace, for each model a pending bar trace, then for each model a batch-size and a
    queue-length line."""
    bars = state.bars(now)
    out = []
    for kind in ("own", "pending"):
        for m in state.models:
            ys, bases, widths, texts = bars[(kind, m)]
            out.append(dict(y=np.asarray(ys, dtype=object), base=np.asarray(bases, dtype=float),
                            x=np.asarray(widths, dtype=float), hovertext=np.asarray(texts, dtype=object)))
    t0 = state.t0 or 0.0
    for m in state.models:
        ser = state.series.get(m)
        ts = np.asarray(ser.t if ser else [], dtype=float) - t0
        out.append(dict(x=ts, y=np.asarray(ser.batch if ser else [], dtype=float)))
        out.append(dict(x=ts, y=np.asarray(ser.queue if ser else [], dtype=float)))
    return out


def timeline_figure(state: TraceState, now: float | None = None, title: str | None = None, widget: bool = False):
    """The run's timeline as a plotly figure (``widget``: a ``go.FigureWidget`` for live updates).

    Args:
        state: a `TraceState` fed with the run's trace.
        now: clock value where running requests' bars end (default: the last event).
        title: figure title (default: the stats line).
        widget: build a ``plotly.graph_objects.FigureWidget`` (needs anywidget, plotly >= 6).

    Returns:
        ``plotly.graph_objects.Figure`` (or ``FigureWidget``).

    Raises:
        ImportError: plotly is not installed (``pip install plotly``).
    """
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError as e:  # pragma: no cover - plotly is a test dependency
        raise ImportError("the timeline needs plotly: pip install 'tokenrouter-sdk[viz]' (or plotly)") from e
    models = state.models
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.12,
                        subplot_titles=("who writes each request (thin bar: pending, KV kept)",
                                        "per model: batch size (solid) and queue length (dotted)"))
    data = figure_data(state, now)
    k = 0
    for kind in ("own", "pending"):
        for m in models:
            d = data[k]
            k += 1
            fig.add_trace(go.Bar(orientation="h", name=f"{m} writes" if kind == "own" else f"pending on {m}",
                                 marker_color=model_color(models, m, strong=True),
                                 opacity=1.0 if kind == "own" else 0.5, width=0.55 if kind == "own" else 0.22,
                                 offset=-0.4 if kind == "own" else 0.18, hoverinfo="text",
                                 legendgroup=m, **d), row=1, col=1)
    for m in models:
        for what in ("batch", "queue"):
            d = data[k]
            k += 1
            fig.add_trace(go.Scatter(mode="lines", name=f"{m} {what}", legendgroup=m, line_shape="hv",
                                     line=dict(color=model_color(models, m, strong=True),
                                               dash="solid" if what == "batch" else "dot"), **d), row=2, col=1)
    if title is None:
        s = state.stats(now)
        title = (f"{s['committed']} committed tokens · {s['tok_s']:.1f} tok/s · hop rate {s['hop_rate']:.3f} "
                 f"· large fraction {s['large_fraction']:.2f}")
    n_req = max(1, len(state.tracks))
    fig.update_layout(title=title, barmode="overlay", height=340 + 22 * min(n_req, 40), template="plotly_white",
                      margin=dict(l=60, r=20, t=70, b=40), legend=dict(orientation="h", y=-0.18))
    fig.update_yaxes(autorange="reversed", row=1, col=1, type="category")
    fig.update_yaxes(title_text="requests", row=2, col=1, rangemode="tozero")
    fig.update_xaxes(title_text="seconds since the first admission", row=2, col=1)
    if widget:
        return go.FigureWidget(fig)
    return fig


def update_figure(fig, state: TraceState, now: float | None = None) -> None:
    """Replace the data of a `timeline_figure` (e.g. a live ``FigureWidget``) with ``state``'s.

    Uses ``plotly_restyle`` per group of traces with the same keys (about 4x cheaper than setting
    each property, which re-validates every array)."""
    data = figure_data(state, now)
    s = state.stats(now)
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(data[:len(fig.data)]):
        groups.setdefault(tuple(d), []).append(i)
    with fig.batch_update():
        for keys, idx in groups.items():
            fig.plotly_restyle({k: [data[i][k] for i in idx] for k in keys}, trace_indexes=idx)
        fig.plotly_relayout({"title.text": f"{s['committed']} committed tokens · {s['tok_s']:.1f} tok/s · hop rate "
                                           f"{s['hop_rate']:.3f} · large fraction {s['large_fraction']:.2f}",
                             "height": 340 + 22 * min(max(1, len(state.tracks)), 40)})
