"""Quality-vs-cost plots of a sweep (plotly): accuracy (or agreement with large-only) against
committed-token throughput or large fraction, the Pareto frontier drawn, references marked."""

from __future__ import annotations

X_AXES = {
    "throughput": ("throughput_tok_s", "committed-token throughput (tokens/s)", True),
    "large_fraction": ("large_fraction", "large fraction (committed tokens by the large model)", False),
    "hop_rate": ("hop_rate", "hop rate (handoffs per committed token)", False),
}
Y_AXES = {"accuracy": ("accuracy", "accuracy"), "agreement": ("agreement", "agreement with large-only answers")}
STYLE = {
    "sweep": ("circle", None),
    "large_only": ("diamond", "black"),
    "small_only": ("square", "grey"),
    "random": ("x", "#d62728"),
    "random_span": ("star", "#ff7f0e"),
    "random_query": ("triangle-up", "#9467bd"),
}
NAMES = {
    "large_only": "large only",
    "small_only": "small only",
    "random": "RandomRouting (matched)",
    "random_span": "RandomSpanRouting (span-matched)",
    "random_query": "RandomQueryRouting (matched)",
}


def _num(v):
    return float("nan") if v is None else v


def pareto_frontier(points: list[tuple[float, float]], x_higher_better: bool = True) -> list[int]:
    """Indices of the points no other point dominates (y higher is better; x higher is better
    when ``x_higher_better``, else lower), sorted by x. Ties in both keep the first."""
    sign = 1 if x_higher_better else -1
    order = sorted(range(len(points)), key=lambda i: (-sign * points[i][0], -points[i][1]))
    out, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            out.append(i)
            best = points[i][1]
    return sorted(out, key=lambda i: points[i][0])


def _axes(x: str, y: str):
    if x not in X_AXES:
        raise ValueError(f"plot x must be one of {sorted(X_AXES)}, got {x!r}")
    if y not in Y_AXES:
        raise ValueError(f"plot y must be one of {sorted(Y_AXES)}, got {y!r}")
    return X_AXES[x], Y_AXES[y]


def quality_figure(records: list[dict], x: str = "throughput", y: str = "accuracy", title: str | None = None):
    """A plotly Figure (a `tokenrouter_sdk.viz.nbfigure.NotebookFigure`, whose notebook output
    also has an HTML form): one trace per swept policy (its points labelled with their value,
    95% CI error bars on accuracy), one per reference kind, a ring around every point with
    failed requests (the hover of each point says how many), and a dashed "Pareto frontier"
    trace over all points with a value for ``y``.

    Raises:
        ValueError: unknown ``x`` or ``y``.
    """
    import plotly.graph_objects as go

    from ..viz.nbfigure import NotebookFigure

    (xcol, xlabel, higher), (ycol, ylabel) = _axes(x, y)
    fig = NotebookFigure()
    rows = [r for r in records if r.get(ycol) is not None and r.get(xcol) is not None]
    groups = []  # (kind, records, trace name)
    for kind in ["sweep", "large_only", "small_only", "random", "random_span", "random_query"]:
        kind_rows = [r for r in rows if r["kind"] == kind]
        if kind != "sweep":
            if kind_rows:
                groups.append((kind, kind_rows, NAMES[kind]))
            continue
        for name in dict.fromkeys(r.get("policy_name") or r["policy"] for r in kind_rows):
            g = [r for r in kind_rows if (r.get("policy_name") or r["policy"]) == name]
            groups.append((kind, g, f"{name} ({g[0]['param']})" if g[0].get("param") else str(name)))
    for kind, kind_rows, name in groups:
        kind_rows.sort(key=lambda r: r[xcol])
        symbol, color = STYLE[kind]
        err = None
        if ycol == "accuracy":
            err = dict(
                type="data",
                symmetric=False,
                array=[r["acc_ci_high"] - r["accuracy"] for r in kind_rows],
                arrayminus=[r["accuracy"] - r["acc_ci_low"] for r in kind_rows],
                thickness=1,
            )
        fig.add_trace(
            go.Scatter(
                x=[r[xcol] for r in kind_rows],
                y=[r[ycol] for r in kind_rows],
                name=name,
                mode="lines+markers+text" if kind == "sweep" else "markers",
                text=[f"{r['value']:.3g}" if kind == "sweep" and r.get("value") is not None else "" for r in kind_rows],
                textposition="top center",
                error_y=err,
                marker=dict(symbol=symbol, size=11 if kind != "sweep" else 9, **({"color": color} if color else {})),
                customdata=[
                    [
                        r["label"],
                        _num(r.get("hop_rate")),
                        _num(r.get("large_fraction")),
                        _num(r.get("throughput_tok_s")),
                        r.get("failed", 0) or 0,
                        r.get("n", "?"),
                        _num(r.get("throughput_min")),
                        _num(r.get("throughput_max")),
                    ]
                    for r in kind_rows
                ],
                hovertemplate="%{customdata[0]}<br>" + ylabel + " %{y:.3f}<br>hop rate %{customdata[1]:.3f}"
                "<br>large fraction %{customdata[2]:.3f}<br>throughput %{customdata[3]:.1f} tok/s "
                "(%{customdata[6]:.1f}-%{customdata[7]:.1f})<br>failed %{customdata[4]} of "
                "%{customdata[5]} requests<extra></extra>",
            )
        )
    bad = [r for r in rows if r.get("failed")]
    if bad:
        fig.add_trace(
            go.Scatter(
                x=[r[xcol] for r in bad],
                y=[r[ycol] for r in bad],
                mode="markers",
                name="points with failed requests",
                marker=dict(symbol="circle-open", size=22, color="#d62728", line=dict(width=2)),
                text=[f"{r['label']}: {r['failed']} of {r.get('n', '?')} requests failed" for r in bad],
                hoverinfo="text",
            )
        )
    front = pareto_frontier([(r[xcol], r[ycol]) for r in rows], higher)
    fig.add_trace(
        go.Scatter(
            x=[rows[i][xcol] for i in front],
            y=[rows[i][ycol] for i in front],
            name="Pareto frontier",
            mode="lines",
            line=dict(dash="dash", color="#2ca02c"),
            hoverinfo="skip",
        )
    )
    fig.update_layout(
        title=title or f"{ylabel} vs {xlabel.split(' (')[0]}",
        xaxis_title=xlabel,
        yaxis_title=ylabel,
        template="plotly_white",
        legend=dict(orientation="h", y=-0.2),
    )
    return fig
