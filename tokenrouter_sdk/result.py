"""`RunResult`: what `Router.generate` returns for a list of prompts. A plain ``list`` of
`RequestOutput` (indexing, ``len``, iteration, equality with a list all behave as before) that
also remembers its call's events, so a finished run can be measured (`RunResult.metrics`) and
looked at: `RunResult.show` (coloured tokens as HTML), `RunResult.timeline` (plotly figure),
`RunResult.to_html` (one standalone page, plotly.js inlined: opens offline). The views live in
`tokenrouter_sdk.viz` and are imported when drawn."""

from __future__ import annotations

import html
import itertools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .viz.htmlview import HTMLView

_ids = itertools.count()


class RunResult(list):
    """The outputs of one `Router.generate` call (a ``list`` of `RequestOutput`, in prompt order)
    and what is needed to draw the run.

    Attributes:
        trace: the run's trace events (its requests' events and the steps in its window).
        models: model names, smallest first.
        tokenizer: the shared tokenizer (to decode tokens one by one).
        entries: rid -> entry model (optional; see `TraceState`).

    Pickling or copying gives a plain ``list`` of the outputs.
    """

    def __init__(self, outputs=(), trace=None, models=None, tokenizer=None, entries=None):
        super().__init__(outputs)
        self.trace = list(trace or [])
        self.models = list(models or sorted({m for o in self for m in o.token_models}))
        self.tokenizer = tokenizer
        self.entries = dict(entries or {})

    def __reduce__(self):
        return (list, (list(self),))

    def metrics(self):
        """`tokenrouter_sdk.metrics.Metrics` of this run (its requests over its window)."""
        from .metrics import compute_metrics
        return compute_metrics(self.trace, {o.rid for o in self}, self.models)

    # -- views ----------------------------------------------------------------------------
    def state(self):
        """A `tokenrouter_sdk.viz.TraceState` fed with this run's events."""
        from .viz.trace import TraceState
        st = TraceState(self.models, {o.rid for o in self}, self.entries)
        st.feed(self.trace)
        return st

    def show(self, which=None, discarded: bool | None = None) -> "HTMLView":
        """The answers as coloured tokens (background = the model that wrote the token).

        Args:
            which: an index or a list of indices into this result (default: all).
            discarded: None: discarded tokens behind a "show discarded tokens" checkbox;
                True: shown (struck through); False: hidden.

        Returns:
            `HTMLView` (Jupyter renders it; ``.html`` is the fragment; ``repr`` is plain text).

        Raises:
            ValueError: no tokenizer (a result built by hand): pass ``tokenizer=`` to `RunResult`.
        """
        from .viz.htmlview import HTMLView
        from .viz.tokens import output_html, page_html
        if self.tokenizer is None:
            raise ValueError("RunResult has no tokenizer to decode tokens: build it with RunResult(outputs, trace, "
                             "models, tokenizer=router.tokenizer)")
        outs = self._pick(which)
        answers = [output_html(o, self.tokenizer, self.models, show_discarded=discarded) for o in outs]
        page = page_html(answers, self.models, toggle_id=f"tr-toggle-{next(_ids)}", toggle=discarded is None)
        return HTMLView(page, self._text(outs))

    def timeline(self, title: str | None = None):
        """The per-request timeline (who owns each request, when it is pending) above per-model
        batch size and queue length over time; a ``plotly.graph_objects.Figure``.

        Raises:
            ImportError: plotly is missing.
        """
        from .viz.figures import timeline_figure
        return timeline_figure(self.state(), title=title)

    def to_html(self, path=None, title: str = "tokenrouter run") -> str:
        """One standalone HTML page: the stats line, the coloured answers and the timeline
        figure with plotly.js inlined (no network needed to open it).

        Args:
            path: also write the page there (UTF-8).
            title: the page title.

        Returns:
            the page as a string.
        """
        fig = self.timeline()
        s = self.state().stats()
        stats = (f"{s['requests']} requests · {s['committed']} committed tokens · {s['tok_s']:.1f} tok/s · "
                 f"hop rate {s['hop_rate']:.3f} · large fraction {s['large_fraction']:.2f} · "
                 f"{s['discarded']} discarded")
        body = (f"<h2>{html.escape(title)}</h2><p class='tr-stats'>{html.escape(stats)}</p>{self.show().html}"
                f"{fig.to_html(full_html=False, include_plotlyjs=True, div_id='tr-timeline')}")
        page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
                f"<body>{body}</body></html>")
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def summary(self) -> str:
        """The stats line as text: committed tokens/s, hop rate, large fraction."""
        s = self.state().stats()
        return (f"{s['finished']}/{s['requests']} requests · {s['committed']} committed tokens in "
                f"{s['elapsed_s']:.2f} s ({s['tok_s']:.1f} tok/s) · hop rate {s['hop_rate']:.3f} · "
                f"large fraction {s['large_fraction']:.2f} · {s['discarded']} discarded")

    # -- helpers --------------------------------------------------------------------------
    def _pick(self, which) -> list:
        if which is None:
            return list(self)
        if isinstance(which, int):
            return [self[which]]
        return [self[i] for i in which]

    def _text(self, outs) -> str:
        from .viz.tokens import token_pieces
        lines = []
        for o in outs:
            pieces = token_pieces(self.tokenizer, list(o.token_ids))
            runs = []
            for m, grp in itertools.groupby(zip(o.token_models, pieces), key=lambda x: x[0]):
                runs.append(f"[{m[:1].upper()}:{''.join(p for _, p in grp)}]")
            lines.append(f"req {o.index}: " + "".join(runs))
        return "\n".join(lines)
