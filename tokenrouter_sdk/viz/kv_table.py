"""`KVStats` (what ``Router.kv_stats`` returns), shown as a table; the table helpers themselves
are `tokenrouter_sdk.tables`."""

from __future__ import annotations

import html

from ..tables import html_table, text_table

KV_COLUMNS = (
    "model",
    "alive",
    "used_blocks",
    "free_blocks",
    "num_blocks",
    "block_size",
    "owned",
    "pending",
    "running_blocks",
    "pending_blocks",
    "cached_blocks",
    "idle_cached",
    "prefix_hit_rate",
    "error",
)


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
        return [
            [
                m,
                s.alive,
                s.num_blocks - s.free_blocks,
                s.free_blocks,
                s.num_blocks,
                s.block_size,
                s.owned,
                s.pending,
                s.running_blocks,
                s.pending_blocks,
                s.cached_blocks,
                s.idle_cached_blocks,
                round(s.hit_rate, 3) if s.prefix_cache else "off",
                s.error,
            ]
            for m, s in self.items()
        ]

    def table(self) -> str:
        """The table as plain text."""
        return text_table(KV_COLUMNS, self.rows())

    def __repr__(self) -> str:
        sizing = "".join(f"\n{line}" for line in self.sizing_lines())
        return f"KV pools (blocks of tokens; owned/pending: requests)\n{self.table()}" + (
            f"\npool sizes:{sizing}" if sizing else ""
        )

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))

    def _repr_html_(self) -> str:
        table = html_table(KV_COLUMNS, self.rows(), caption="KV pools (blocks of tokens; owned/pending: requests)")
        lines = "".join(f"<li>{html.escape(line)}</li>" for line in self.sizing_lines())
        return table + (f"<p>pool sizes:</p><ul>{lines}</ul>" if lines else "")
