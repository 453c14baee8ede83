"""`RunResult`: what `Router.generate` returns for a list of prompts. A plain ``list`` of
`RequestOutput` (indexing, ``len``, iteration, equality with a list all behave as before) that
also remembers its call's events, so a finished run can be measured (`RunResult.metrics`) and
looked at: `RunResult.show` (coloured tokens as HTML), `RunResult.timeline` (plotly figure),
`RunResult.to_html` (one standalone page, plotly.js inlined: opens offline). In a notebook it
shows as a table (``_repr_html_``). The views live in `tokenrouter_sdk.viz` and are imported
when drawn.

A `RunResult` holds no reference to its Router or engine: its outputs, events, model names,
the tokenizer (only to decode tokens for the views) and the decoded token pieces. Pickled, it
keeps its class, events and the decoded pieces instead of the tokenizer, so an unpickled run
still draws itself (``show``, ``timeline``, ``summary``, ``metrics``).
"""

from __future__ import annotations

import html
import itertools
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .viz.htmlview import HTMLView


def _restore(outputs, trace, models, entries, pieces) -> "RunResult":
    return RunResult(outputs, trace, models, None, entries, pieces)


class RunResult(list):
    """The outputs of one `Router.generate` call (a ``list`` of `RequestOutput`, in prompt order)
    and what is needed to draw the run.

    Attributes:
        trace: the run's trace events (its requests' events and the steps in its window).
        models: model names, smallest first.
        tokenizer: the shared tokenizer (to decode tokens one by one); None after unpickling.
        entries: rid -> entry model (optional; see `TraceState`).
        vocabs: for models that do not share a tokenizer, model -> its
            `tokenrouter_sdk.byte_vocab.ByteVocab` (each token is decoded from its writer's
            bytes); None after unpickling.

    Args:
        pieces: rid -> (text of each committed token, text of each discarded token), e.g. from
            `pieces`; used instead of the tokenizer where given.
    """

    def __init__(self, outputs=(), trace=None, models=None, tokenizer=None, entries=None, pieces=None, vocabs=None):
        super().__init__(outputs)
        self.trace = list(trace or [])
        self.models = list(models or sorted({m for o in self for m in o.token_models}))
        self.tokenizer = tokenizer
        self.entries = dict(entries or {})
        self._pieces: dict = dict(pieces or {})
        self.vocabs = vocabs

    def __reduce__(self):
        return (_restore, (list(self), self.trace, self.models, self.entries, self.pieces()))

    def __copy__(self) -> "RunResult":
        return RunResult(self, self.trace, self.models, self.tokenizer, self.entries, self._pieces, self.vocabs)

    def pieces(self) -> dict:
        """rid -> (text of each committed token, text of each discarded token), decoded once with
        the tokenizer (`tokenrouter_sdk.viz.tokens.token_pieces`) and cached.

        Raises:
            ValueError: an output was never decoded and there is no tokenizer (a result built by
                hand): pass ``tokenizer=`` to `RunResult`.
        """
        from .viz.tokens import output_pieces

        for o in self:
            if o.rid not in self._pieces:
                if self.tokenizer is None and self.vocabs is None:
                    raise ValueError(
                        "RunResult has no tokenizer to decode tokens: build it with RunResult(outputs, "
                        "trace, models, tokenizer=router.tokenizer)"
                    )
                self._pieces[o.rid] = output_pieces(o, self.tokenizer, self.vocabs)
        return {o.rid: self._pieces[o.rid] for o in self}

    def metrics(self):
        """`tokenrouter_sdk.metrics.Metrics` of this run (its requests over its window)."""
        from .metrics import compute_metrics

        return compute_metrics(self.trace, {o.rid for o in self}, self.models)

    # -- views ----------------------------------------------------------------------------
    def state(self):
        """A `tokenrouter_sdk.viz.TraceState` fed with this run's events."""
        from .viz.trace import TraceState

        st = TraceState(self.models, {o.rid for o in self}, self.entries, {o.rid: o.index for o in self})
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
            ValueError: no tokenizer and no decoded pieces (a result built by hand): pass
                ``tokenizer=`` to `RunResult`.
        """
        from .viz.htmlview import HTMLView
        from .viz.tokens import output_html, page_html

        outs = self._pick(which)
        pieces = self.pieces()
        answers = [output_html(o, pieces[o.rid], self.models, show_discarded=discarded) for o in outs]
        page = page_html(answers, self.models, toggle_id=f"tr-toggle-{uuid.uuid4().hex[:12]}", toggle=discarded is None)
        return HTMLView(page, self._text(outs))

    def timeline(self, title: str | None = None):
        """The per-request timeline (who owns each request, when it is pending; rows labelled by
        the request's index in the call) above per-model batch size and queue length over time;
        a ``plotly.graph_objects.Figure`` (a `tokenrouter_sdk.viz.nbfigure.NotebookFigure`: in a
        notebook it also carries an HTML form, so exported notebooks show it).

        Raises:
            ImportError: plotly is missing.
        """
        from .viz.figures import timeline_figure

        return timeline_figure(self.state(), title=title)

    def to_html(self, path=None, title: str = "tokenrouter run") -> str:
        """One standalone HTML page: the stats line, the coloured answers and the timeline
        figure with plotly.js inlined (no network needed to open it).

        Args:
            path: write the page there (UTF-8).
            title: the page title.

        Returns:
            the `Path` written when ``path`` is given (so a notebook cell ending in
            ``outs.to_html("run.html")`` shows the path, not the page); else the page as a string.
        """
        fig = self.timeline()
        s = self.state().stats()
        stats = (
            f"{s['requests']} requests · {s['committed']} committed tokens · {s['tok_s']:.1f} tok/s · "
            f"hop rate {s['hop_rate']:.3f} · large fraction {s['large_fraction']:.2f} · "
            f"{s['discarded']} discarded"
        )
        body = (
            f"<h2>{html.escape(title)}</h2><p class='tr-stats'>{html.escape(stats)}</p>{self.show().html}"
            f"{fig.to_html(full_html=False, include_plotlyjs=True, div_id='tr-timeline')}"
        )
        page = (
            f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body>{body}</body></html>"
        )
        if path is not None:
            path = Path(path)
            path.write_text(page, encoding="utf-8")
            return path
        return page

    def summary(self) -> str:
        """The stats line as text: committed tokens/s, hop rate, large fraction."""
        s = self.state().stats()
        return (
            f"{s['finished']}/{s['requests']} requests · {s['committed']} committed tokens in "
            f"{s['elapsed_s']:.2f} s ({s['tok_s']:.1f} tok/s) · hop rate {s['hop_rate']:.3f} · "
            f"large fraction {s['large_fraction']:.2f} · {s['discarded']} discarded"
        )

    # -- helpers --------------------------------------------------------------------------
    def _pick(self, which) -> list:
        if which is None:
            return list(self)
        if isinstance(which, int):
            return [self[which]]
        return [self[i] for i in which]

    def _text(self, outs) -> str:
        pieces = self.pieces()
        lines = []
        for o in outs:
            runs = []
            for m, grp in itertools.groupby(zip(o.token_models, pieces[o.rid][0]), key=lambda x: x[0]):
                runs.append(f"[{m[:1].upper()}:{''.join(p for _, p in grp)}]")
            lines.append(f"req {o.index}: " + "".join(runs))
        return "\n".join(lines)

    # -- notebook and terminal forms -------------------------------------------------------
    _COLUMNS = ("req", "finish", "tokens", "hops", "large_share", "ttft_s", "latency_s", "text")
    _ALIGN = "rlrrrrrl"

    def _rows(self, width: int) -> list[list]:
        big = self.models[-1] if self.models else None
        rows = []
        for o in self:
            n = len(o.token_ids)
            text = o.text if o.finish_reason != "failed" else f"error: {o.error}"
            text = " ".join(str(text).split())
            rows.append(
                [
                    o.index,
                    o.finish_reason,
                    n,
                    o.hops,
                    sum(m == big for m in o.token_models) / n if n else 0.0,
                    o.ttft_s,
                    o.latency_s,
                    text if len(text) <= width else text[: width - 1] + "…",
                ]
            )
        return rows

    def __repr__(self) -> str:
        from .tables import text_table

        head = f"RunResult of {len(self)} requests: {self.summary()}"
        return head + "\n" + text_table(self._COLUMNS, self._rows(60), self._ALIGN)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text("RunResult([...])" if cycle else repr(self))

    def _repr_html_(self) -> str:
        """A table of the answers (index, how each ended, tokens, hops, share written by the
        largest model, times in seconds, the text) under the stats line."""
        from .tables import html_table

        return (
            f"<div class='tr-run'><p>{html.escape(self.summary())} · <code>.show()</code> colours the "
            f"tokens, <code>.timeline()</code> draws the run</p>"
            f"{html_table(self._COLUMNS, self._rows(160), align=self._ALIGN)}</div>"
        )
