"""Plotly figures of a run: the per-request timeline and the per-model batch / queue series.

`timeline_figure` builds the figure with a fixed trace order; `figure_data` computes the data
of each trace from a `TraceState`, so the live view redraws (`timeline_spec`) with the same
function that draws a finished run.

Rows: (1) one bar row per request: a full-height bar in the colour of the model that owns
(writes) it, and under it a thin bar for each model where it is pending (handed off, KV kept);
(2) per model, the batch size of each step (solid steps) and the queue length (dotted: requests
it owns that were not in the step). x: seconds since the first admission.
"""

from __future__ import annotations

from .tokens import model_color
from .trace import TraceState


def figure_data(state: TraceState, now: float | None = None) -> list[dict]:
    """Per-trace data (plain lists), in the order of `timeline_figure`'s traces: for each model an
    ownership bar trace, for each model a pending bar trace, then for each model a batch-size and
    a queue-length line. Times in seconds since ``state.t0``."""
    bars = state.bars(now)
    out = []
    for kind in ("own", "pending"):
        for m in state.models:
            ys, bases, widths, texts = bars[(kind, m)]
            out.append(
                dict(y=list(ys), base=[float(b) for b in bases], x=[float(w) for w in widths], hovertext=list(texts))
            )
    t0 = state.t0 or 0.0
    for m in state.models:
        ser = state.series.get(m)
        out.append(
            dict(x=[float(t) - t0 for t in ser.t] if ser else [], y=[float(b) for b in ser.batch] if ser else [])
        )
        out.append(
            dict(x=[float(t) - t0 for t in ser.t] if ser else [], y=[float(q) for q in ser.queue] if ser else [])
        )
    return out


def _title(state: TraceState, now: float | None) -> str:
    s = state.stats(now)
    return (
        f"{s['committed']} committed tokens · {s['tok_s']:.1f} tok/s · hop rate {s['hop_rate']:.3f} "
        f"· large fraction {s['large_fraction']:.2f}"
    )


def _height(state: TraceState) -> int:
    return 340 + 22 * min(max(1, len(state.tracks)), 40)


def timeline_figure(state: TraceState, now: float | None = None, title: str | None = None):
    """The run's timeline as a plotly figure.

    Args:
        state: a `TraceState` fed with the run's trace.
        now: clock value where running requests' bars end (default: the last event).
        title: figure title (default: the stats line).

    Returns:
        a `tokenrouter_sdk.viz.nbfigure.NotebookFigure` (a ``plotly.graph_objects.Figure``
        whose notebook output also has an HTML form, so exported notebooks and the docs show it).

    Raises:
        ImportError: plotly is not installed (``pip install plotly``).
    """
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        from .nbfigure import NotebookFigure
    except ImportError as e:  # pragma: no cover - plotly is a test dependency
        raise ImportError("the timeline needs plotly: pip install 'tokenrouter-sdk[viz]' (or plotly)") from e
    models = state.models
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.68, 0.32],
        vertical_spacing=0.12,
        subplot_titles=(
            "who writes each request (thin bar: pending, KV kept)",
            "per model: batch size (solid) and queue length (dotted)",
        ),
    )
    data = figure_data(state, now)
    k = 0
    for kind in ("own", "pending"):
        for m in models:
            d = data[k]
            k += 1
            fig.add_trace(
                go.Bar(
                    orientation="h",
                    name=f"{m} writes" if kind == "own" else f"pending on {m}",
                    marker_color=model_color(models, m, strong=True),
                    opacity=1.0 if kind == "own" else 0.5,
                    width=0.55 if kind == "own" else 0.22,
                    offset=-0.4 if kind == "own" else 0.18,
                    hoverinfo="text",
                    legendgroup=m,
                    **d,
                ),
                row=1,
                col=1,
            )
    for m in models:
        for what in ("batch", "queue"):
            d = data[k]
            k += 1
            fig.add_trace(
                go.Scatter(
                    mode="lines",
                    name=f"{m} {what}",
                    legendgroup=m,
                    line_shape="hv",
                    line=dict(color=model_color(models, m, strong=True), dash="solid" if what == "batch" else "dot"),
                    **d,
                ),
                row=2,
                col=1,
            )
    fig.update_layout(
        title=title if title is not None else _title(state, now),
        barmode="overlay",
        height=_height(state),
        template="plotly_white",
        margin=dict(l=60, r=20, t=70, b=40),
        legend=dict(orientation="h", y=-0.18),
    )
    fig.update_yaxes(autorange="reversed", row=1, col=1, type="category")
    fig.update_yaxes(title_text="requests", row=2, col=1, rangemode="tozero")
    fig.update_xaxes(title_text="seconds since the first admission", row=2, col=1)
    return NotebookFigure(fig)


def timeline_spec(state: TraceState, base: dict, now: float | None = None) -> dict:
    """The timeline as plotly JSON (a dict) without building a figure: ``base``'s traces and
    layout with ``state``'s data, title and height. The live view's redraw (about 1 ms plus the
    data, against ~0.2 s for `timeline_figure`).

    Args:
        state: the `TraceState`.
        base: ``timeline_figure(...).to_plotly_json()`` of a state with the same models (only
            its styling is used).
        now: clock value where running requests' bars end.
    """
    data = [dict(trace, **d) for trace, d in zip(base["data"], figure_data(state, now))]
    layout = dict(
        base["layout"], title={**(base["layout"].get("title") or {}), "text": _title(state, now)}, height=_height(state)
    )
    return {"data": data, "layout": layout}
