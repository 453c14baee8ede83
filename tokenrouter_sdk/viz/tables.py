"""Small tables for notebooks and terminals: the HTML and text forms of `Metrics`, `RunResult`,
`EvalResult` and `KVStats` (what ``Router.kv_stats`` returns)."""

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


def html_table(headers: Sequence[str], rows: Sequence[Sequence], caption: str | None = None,
               align: str | None = None) -> str:
    """An HTML ``<table>``; ``align`` has one letter per column, ``l`` (left: labels, text) or
    ``r`` (right: numbers), default the first column left and the others right. Floats with 4
    significant digits, None as ``-``."""
    al = ["left" if a == "l" else "right" for a in _align(headers, align)]
    cap = f"<caption style='text-align:left;font-weight:600'>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th style='text-align:{al[i]}'>{html.escape(h)}</th>" for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td style='text-align:{al[i]}'>{html.escape(_cell(v))}</td>"
                                    for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table class='tr-table'>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_table(headers: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """The same table as aligned plain text (one line per row)."""
    al = _align(headers, align)
    cells = [list(headers)] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) if al[i] == "l" else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in cells)


KV_COLUMNS = ("model", "alive", "used_blocks", "free_blocks", "num_blocks", "block_size", "owned", "pending",
              "running_blocks", "pending_blocks", "cached_blocks", "idle_cached", "prefix_hit_rate", "error")


class KVStats(dict):
    """What `Router.kv_stats` returns: model -> `tokenrouter_sdk.engine.messages.Stats` (a
    ``dict``), shown as a table: per model whether its sub-server is alive, KV blocks used / free
    (idle cached blocks count as free) / usable, tokens per block, requests it owns and holds
    pending, the block references each group holds, the prefix cache's blocks (all, and those
    no request holds) and its hit rate since the sub-server started (tokens reused / looked up;
    "off" when the cache is off). ``sizing``: per model, how its pool was sized
    (`tokenrouter_sdk.kv_sizing.KVSizing`), shown under the table."""

    def __init__(self, stats=(), sizing: dict | None = None):
        super().__init__(stats)
        self.sizing = dict(sizing or {})

    def sizing_lines(self) -> list[str]:
        return [f"{m}: {z.describe()}" for m, z in self.sizing.items()]

    def rows(self) -> list[list]:
        return [[m, s.alive, s.num_blocks - s.free_blocks, s.free_blocks, s.num_blocks, s.block_size, s.owned,
                 s.pending, s.running_blocks, s.pending_blocks, s.cached_blocks, s.idle_cached_blocks,
                 round(s.hit_rate, 3) if s.prefix_cache else "off", s.error] for m, s in self.items()]

    def table(self) -> str:
        """The table as plain text."""
        return text_table(KV_COLUMNS, self.rows())

    def __repr__(self) -> str:
        sizing = "".join(f"\n{line}" for line in self.sizing_lines())
        return f"KV pools (blocks of tokens; owned/pending: requests)\n{self.table()}" + (
            f"\npool sizes:{sizing}" if sizing else "")

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))

    def _repr_html_(self) -> str:
        import html
        table = html_table(KV_COLUMNS, self.rows(), caption="KV pools (blocks of tokens; owned/pending: requests)")
        lines = "".join(f"<li>{html.escape(line)}</li>" for line in self.sizing_lines())
        return table + (f"<p>pool sizes:</p><ul>{lines}</ul>" if lines else "")
