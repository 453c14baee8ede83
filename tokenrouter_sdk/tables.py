"""Plain tables, as HTML (notebooks) and aligned text (terminals): what `Metrics`, `RunResult`,
`EvalResult` and `KVStats` render with. No package imports: every layer may use it."""

from __future__ import annotations

import html
from typing import Sequence


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _align(headers: Sequence[str], align: str | None) -> str:
    return align if align is not None else "l" + "r" * (len(headers) - 1)


def html_table(
    headers: Sequence[str], rows: Sequence[Sequence], caption: str | None = None, align: str | None = None
) -> str:
    """An HTML ``<table>``; ``align`` has one letter per column, ``l`` (left: labels, text) or
    ``r`` (right: numbers), default the first column left and the others right. Floats with 4
    significant digits, None as ``-``."""
    al = ["left" if a == "l" else "right" for a in _align(headers, align)]
    cap = f"<caption style='text-align:left;font-weight:600'>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th style='text-align:{al[i]}'>{html.escape(h)}</th>" for i, h in enumerate(headers))
    body = "".join(
        "<tr>"
        + "".join(f"<td style='text-align:{al[i]}'>{html.escape(_cell(v))}</td>" for i, v in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table class='tr-table'>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_table(headers: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """The same table as aligned plain text (one line per row)."""
    al = _align(headers, align)
    cells = [list(headers)] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) if al[i] == "l" else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in cells
    )
