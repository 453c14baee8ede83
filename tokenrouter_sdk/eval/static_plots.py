"""Static quality-vs-cost figures of a sweep (PNG, PDF, SVG) for a paper, drawn with matplotlib:
the same points, references, failure rings and Pareto frontier as the interactive plots of
`tokenrouter_sdk.eval.plots`, with tick labels and point labels rounded to 3 significant digits.

matplotlib is an optional dependency (``pip install 'tokenrouter-sdk[figures]'``, also in the
``eval`` extra); it is imported when a figure is drawn. Figures are built with matplotlib's
object API on the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

from pathlib import Path

from .plots import NAMES, X_AXES, Y_AXES, _axes, pareto_frontier

FORMATS = ("png", "pdf", "svg")
MARKERS = {"sweep": "o", "large_only": "D", "small_only": "s", "random": "x", "random_span": "*", "random_query": "^"}
COLORS = {
    "large_only": "black",
    "small_only": "grey",
    "random": "#d62728",
    "random_span": "#ff7f0e",
    "random_query": "#9467bd",
}
POLICY_COLORS = ("#1f77b4", "#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def _short(v) -> str:
    """A number in at most 3 significant digits (``0.301998`` -> ``0.302``)."""
    return f"{v:.3g}"


def static_figure(records: list[dict], x: str = "throughput", y: str = "accuracy", title: str | None = None):
    """A `matplotlib.figure.Figure` of ``y`` (``"accuracy"`` or ``"agreement"``) against ``x``
    (``"throughput"``, ``"large_fraction"`` or ``"hop_rate"``): a line per swept policy with its
    points labelled by their value, a marker per reference, 95% CI error bars on accuracy, a red
    ring around points with failed requests and the dashed Pareto frontier.

    Raises:
        ValueError: unknown ``x`` or ``y``.
        ImportError: matplotlib is not installed (says how to install it).
    """
    (xcol, xlabel, higher), (ycol, ylabel) = _axes(x, y)
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError as e:
        raise ImportError(f"static figures need matplotlib: pip install 'tokenrouter-sdk[figures]' ({e})") from e
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.add_subplot()
    rows = [r for r in records if r.get(ycol) is not None and r.get(xcol) is not None]
    policies = list(dict.fromkeys(r.get("policy_name") or r["policy"] for r in rows if r["kind"] == "sweep"))
    for i, name in enumerate(policies):
        sweep_rows = sorted(
            (r for r in rows if r["kind"] == "sweep" and (r.get("policy_name") or r["policy"]) == name),
            key=lambda r: r[xcol],
        )
        color = POLICY_COLORS[i % len(POLICY_COLORS)]
        label = f"{name} ({sweep_rows[0]['param']})" if sweep_rows[0].get("param") else str(name)
        _points(ax, sweep_rows, xcol, ycol, color=color, marker=MARKERS["sweep"], label=label, line=True)
        for r in sweep_rows:
            if r.get("value") is not None:
                ax.annotate(
                    _short(r["value"]),
                    (r[xcol], r[ycol]),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                    color=color,
                )
    for kind in ("large_only", "small_only", "random", "random_span", "random_query"):
        sweep_rows = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r[xcol])
        if sweep_rows:
            _points(ax, sweep_rows, xcol, ycol, color=COLORS[kind], marker=MARKERS[kind], label=NAMES[kind], line=False)
    bad = [r for r in rows if r.get("failed")]
    if bad:
        ax.scatter(
            [r[xcol] for r in bad],
            [r[ycol] for r in bad],
            s=260,
            facecolors="none",
            edgecolors="#d62728",
            linewidths=1.5,
            label="points with failed requests",
            zorder=4,
        )
    front = pareto_frontier([(r[xcol], r[ycol]) for r in rows], higher)
    if front:
        ax.plot(
            [rows[i][xcol] for i in front],
            [rows[i][ycol] for i in front],
            linestyle="--",
            color="#2ca02c",
            linewidth=1,
            label="Pareto frontier",
            zorder=1,
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{ylabel} vs {xlabel.split(' (')[0]}", fontsize=11)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=6))
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}"))
    ax.grid(True, linewidth=0.4, alpha=0.5)
    if rows:
        ax.legend(fontsize=8, loc="best")
    return fig


def _points(
    ax, sweep_rows: list[dict], xcol: str, ycol: str, *, color: str, marker: str, label: str, line: bool
) -> None:
    xs, ys = [r[xcol] for r in sweep_rows], [r[ycol] for r in sweep_rows]
    err = None
    if ycol == "accuracy" and all(
        r.get("acc_ci_low") is not None and r.get("acc_ci_high") is not None for r in sweep_rows
    ):
        err = [
            [r["accuracy"] - r["acc_ci_low"] for r in sweep_rows],
            [r["acc_ci_high"] - r["accuracy"] for r in sweep_rows],
        ]
    ax.errorbar(
        xs,
        ys,
        yerr=err,
        color=color,
        marker=marker,
        linestyle="-" if line else "none",
        markersize=6,
        elinewidth=0.8,
        capsize=2,
        label=label,
        zorder=3,
    )


def save_static(
    records: list[dict], folder, plots: list[tuple[str, str]], *, formats=("png", "pdf"), title_of=None
) -> list[Path]:
    """Write ``static_figure`` of every ``(x, y)`` in ``plots`` into ``folder`` as
    ``{y}_vs_{x}.{format}`` for each format; returns the paths written.

    Raises:
        ValueError: a format matplotlib cannot write here (not one of ``FORMATS``).
        ImportError: matplotlib is not installed.
    """
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"figure formats must be among {list(FORMATS)}, got {bad}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for x, y in plots:
        fig = static_figure(records, x=x, y=y, title=title_of(x, y) if title_of else None)
        for fmt in formats:
            path = folder / f"{y}_vs_{x}.{fmt}"
            fig.savefig(path, dpi=200 if fmt == "png" else None)
            out.append(path)
    return out


__all__ = ["FORMATS", "X_AXES", "Y_AXES", "save_static", "static_figure"]
