"""The live hop view behind ``Router.generate(..., live=True)``.

Design: no extra thread. The caller's thread, which would otherwise block until the requests
end, wakes every ``interval`` seconds (default 0.25 s: four updates per second), reads the
call's events appended since its last look (the engine appends them as sub-server events
arrive, from threads or, in process mode, from the pyzmq hub thread: the same events either
way) and the handles' growing outputs, and redraws. Generation never waits for the view.

In a notebook (an IPython kernel with ipywidgets and plotly): a stats line (committed tokens/s,
hop rate, large fraction, prefix-cache hit rate), the answers as they are written with tokens coloured by model (a
checkbox shows the discarded tokens; pure CSS, it works while the kernel is busy), and the
timeline: per-request ownership / pending and per-model batch size and queue length, redrawn as
plotly JSON in an ``Output`` widget (nothing heavy travels: no plotly.js in the widget state).
When the run ends (or is interrupted), the widget collapses into static outputs: the answers as
HTML and the timeline as a figure with an HTML form, so a saved or exported notebook shows the
final state without widget state; the widgets are then closed. Elsewhere, or without
ipywidgets/plotly (a one-line notice says so): a ``tqdm`` bar of finished requests with the
stats as its postfix and a final text summary.

The view holds its engine and call only while the run lasts: afterwards it keeps the
tokenizer, the model names and what it drew, never the Router, its engine or its processes.
"""

from __future__ import annotations

import json
import sys
import time
import uuid

from .tokens import _piece_at, answer_html, byte_pieces, page_html, token_pieces
from .trace import TraceState

PLOTLY_MIME = "application/vnd.plotly.v1+json"


def in_notebook() -> bool:
    """True inside a Jupyter kernel (an IPython shell with a kernel attached)."""
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    try:
        shell = ip.get_ipython()
    except Exception:  # noqa: BLE001
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def _widget_modules_missing() -> str | None:
    """The first of ipywidgets / plotly that cannot be imported (None: both can)."""
    for name in ("ipywidgets", "plotly"):
        try:
            __import__(name)
        except ImportError:
            return name
    return None


class LiveView:
    """Follows one `Router.generate` call's requests and draws them while they run.

    Args:
        router: the `Router` (its tokenizer, models and engine are read; the view does not keep
            the Router).
        handles: the call (`tokenrouter_sdk.engine.front.call.Call`: its handles and events).
        kind: ``"auto"`` (widgets in a notebook, else text), ``"widget"`` or ``"text"``.
            ``"widget"`` outside a notebook builds and updates the widgets without displaying
            them (used to measure the view's cost). ``"auto"`` in a notebook without
            ipywidgets or plotly prints a one-line notice and uses the text view.
        interval: seconds between redraws (throttle), > 0.
        max_share: the view's time budget as a share of wall time: after a redraw that took
            ``c`` seconds the next one waits at least ``c / max_share`` (default 0.03: a slow
            frontend redraws less often rather than slowing generation).
        out: stream of the text summary and notices (default ``sys.stdout``).

    Raises:
        ValueError: unknown ``kind`` or ``interval <= 0``.
        ImportError: ``kind="widget"`` without ipywidgets or plotly installed.
    """

    def __init__(self, router, handles, kind: str = "auto", interval: float = 0.25, out=None, max_share: float = 0.03):
        if kind not in ("auto", "widget", "text"):
            raise ValueError(f"live view kind must be 'auto', 'widget' or 'text', got {kind!r}")
        if not interval > 0:
            raise ValueError(f"live view interval must be > 0 seconds, got {interval!r}")
        self.router, self.call, self.handles = router, handles, list(handles)
        self.tokenizer, self.models = router.tokenizer, list(router.models)
        text = getattr(router, "text", None)
        self.vocabs = text.vocabs if text is not None else None  # models without one shared tokenizer
        self.interval, self.out = interval, out
        self.displayed = in_notebook()
        self.kind = ("widget" if self.displayed else "text") if kind == "auto" else kind
        self.fallback = None
        if kind == "auto" and self.kind == "widget":
            self.fallback = _widget_modules_missing()
            if self.fallback:
                self.kind = "text"
                print(
                    f"live view: {self.fallback} is not installed, showing the text view "
                    f"(pip install 'tokenrouter-sdk[viz]' for the notebook view)",
                    file=self.out or sys.stdout,
                )
        self.state = TraceState(
            self.models,
            {h.rid for h in self.handles},
            {h.rid: h.entry for h in self.handles},
            {h.rid: h.output.index for h in self.handles},
        )
        self._index = {h.rid: h.output.index for h in self.handles}
        self._pos = 0
        self._pieces: dict[int, list[str]] = {h.rid: [] for h in self.handles}
        self._dpieces: dict[int, list[str]] = {}
        self._html: dict[int, str] = {}
        self._n_seen: dict[int, tuple] = {}
        self._snap: dict = {}
        self._final = False
        self._closed = False
        self._handle = None
        self.updates = 0
        self.update_s = 0.0
        self.max_share = max_share
        self.gap = interval
        self._build()
        router.last_view = self  # after the run: router.last_view.summary(), .update_s, .figure()

    # -- frontends ------------------------------------------------------------------------
    def _build(self) -> None:
        if self.kind == "text":
            if self.fallback:
                from tqdm import tqdm  # the notebook bar of tqdm.auto needs ipywidgets
            else:
                from tqdm.auto import tqdm
            self.bar = tqdm(total=len(self.handles), desc="requests", file=self.out, leave=True)
            return
        import ipywidgets as W
        import plotly.io as pio

        from .figures import timeline_figure

        self.css_class = f"tr-live-{uuid.uuid4().hex[:12]}"  # unique across kernel sessions
        self.stats = W.HTML()
        self.toggle = W.HTML(
            f"<style>.{self.css_class}:has(input.tr-toggle:checked) .tr-disc{{display:inline}}</style>"
            f"<label style='font-size:13px'><input type='checkbox' class='tr-toggle'> show discarded tokens</label>"
        )
        self.answers = W.HTML(layout=W.Layout(max_height="360px", overflow="auto"))
        self.plot = W.Output()
        self._base = json.loads(pio.to_json(timeline_figure(self.state, title="starting"), validate=False))
        self.widget = W.VBox([self.stats, self.toggle, self.answers, self.plot])
        self.widget.add_class(self.css_class)
        if self.displayed:
            from IPython.display import display

            self._handle = display(self.widget, display_id=True)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every request ends, redrawing every ``interval`` seconds; a final
        redraw (and, for text, the summary) at the end.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the caller aborts the requests).
        """
        deadline = None if timeout is None else time.perf_counter() + timeout
        last = 0.0
        for h in self.handles:
            while not h.done.is_set():
                h.done.wait(self.interval)
                if deadline is not None and time.perf_counter() > deadline and not h.done.is_set():
                    raise TimeoutError(f"request {h.output.index} did not finish within {timeout} s")
                self.router.check_alive()
                if time.perf_counter() - last >= self.gap:
                    self.update()
                    last = time.perf_counter()
        self.update(final=True)

    def update(self, final: bool = False) -> None:
        """Read what is new in the trace and the outputs, and redraw (no-op once closed)."""
        if self.call is None:
            return
        t = time.perf_counter()
        with self.router.consistent():
            new = self.call.events_since(self._pos)
            self._pos += len(new)
            snap = {
                h.rid: (
                    list(h.output.token_ids),
                    list(h.output.token_models),
                    list(h.output.discarded_log),
                    h.output.finish_reason,
                    h.output.hops,
                )
                for h in self.handles
            }
        self.state.feed(new)
        self._final = self._final or final
        now = None if final else time.perf_counter()
        if self.kind == "text":
            s = self.state.stats(now)
            self.bar.n = s["finished"]
            self.bar.set_postfix_str(
                f"{s['tok_s']:.1f} tok/s, hop rate {s['hop_rate']:.3f}, "
                f"large {s['large_fraction']:.2f}, prefix hit {s['prefix_hit_rate']:.2f}",
                refresh=True,
            )
            if final:
                self.bar.close()
                print(self.summary(), file=self.out or sys.stdout)
        else:
            self._snap = snap
            self._redraw_answers()
            self.stats.value = self._stats_html(now)
            self.plot.outputs = ({"output_type": "display_data", "data": self._plot_bundle(now), "metadata": {}},)
        self.updates += 1
        cost = time.perf_counter() - t
        self.update_s += cost
        self.gap = max(self.interval, cost / self.max_share)

    def _stats_html(self, now=None) -> str:
        s = self.state.stats(now)
        return (
            f"<b>{s['finished']}/{s['requests']}</b> requests · <b>{s['tok_s']:.1f}</b> "
            f"committed tok/s · hop rate <b>{s['hop_rate']:.3f}</b> · large fraction "
            f"<b>{s['large_fraction']:.2f}</b> · prefix-cache hit rate <b>{s['prefix_hit_rate']:.2f}</b> · "
            f"{s['discarded']} discarded · {s['elapsed_s']:.1f} s"
        )

    def _plot_bundle(self, now=None) -> dict:
        from .figures import timeline_spec
        from .plotlyjs import figure_html

        spec = timeline_spec(self.state, self._base, now)
        return {PLOTLY_MIME: spec, "text/html": figure_html(spec), "text/plain": "<live timeline>"}

    def _redraw_answers(self) -> None:
        tok, models = self.tokenizer, self.models
        for rid, (ids, token_models, log, reason, hops) in self._snap.items():
            key = (len(ids), len(log), reason)
            if self._n_seen.get(rid) == key:
                continue
            pieces = self._pieces[rid]
            dpieces = self._dpieces.setdefault(rid, [])
            if self.vocabs is not None:
                pieces[:] = byte_pieces(ids, token_models[: len(ids)], self.vocabs)
                dpieces.extend(self.vocabs[m].table[t].decode("utf-8", "replace") for _p, t, m in log[len(dpieces) :])
            else:
                if len(ids) > len(pieces):
                    pieces.extend(token_pieces(tok, ids, start=len(pieces)))
                dpieces.extend(_piece_at(tok, ids, pos, t) for pos, t, _m in log[len(dpieces) :])
            title = f"req {self._index[rid]} · {reason or 'running'} · {len(pieces)} tokens · {hops} hops"
            self._html[rid] = answer_html(pieces, token_models[: len(pieces)], models, log, dpieces, title)
            self._n_seen[rid] = key
        self.answers.value = self._answers_page(toggle=False)

    def _answers_page(self, toggle: bool) -> str:
        return page_html(
            [self._html[r] for r in sorted(self._html, key=self._index.get)],
            self.models,
            toggle_id=f"tr-toggle-{self.css_class}",
            toggle=toggle,
        )

    # -- after the run ----------------------------------------------------------------------
    def figure(self):
        """The timeline as drawn last, as a `tokenrouter_sdk.viz.nbfigure.NotebookFigure`."""
        from .figures import timeline_figure

        return timeline_figure(self.state, None if self._final else time.perf_counter())

    def summary(self) -> str:
        """The final text summary: stats line and one line per model."""
        s = self.state.stats()
        lines = [
            f"{s['finished']}/{s['requests']} requests · {s['committed']} committed tokens in "
            f"{s['elapsed_s']:.2f} s ({s['tok_s']:.1f} tok/s) · hop rate {s['hop_rate']:.3f} · "
            f"large fraction {s['large_fraction']:.2f} · prefix hit {s['prefix_hit_rate']:.2f} · "
            f"{s['discarded']} discarded"
        ]
        for m in self.state.models:
            ser = self.state.series[m]
            mean_b = sum(ser.batch) / len(ser.batch) if ser.batch else 0.0
            lines.append(
                f"  {m}: {len(ser.t)} steps, mean batch {mean_b:.1f}, max queue "
                f"{max(ser.queue, default=0)}, {self.state.tokens_by_model[m]} tokens written"
            )
        return "\n".join(lines)

    def close(self) -> None:
        """End the view (idempotent; `Router.generate` calls it when the call ends, however it
        ends): redraw what the run reached, replace a displayed widget by static outputs (the
        answers as HTML, the timeline figure), close the widgets and drop the engine and call."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._final and self.handles:
                self.update(final=True)
        finally:
            self.router = self.call = self.handles = None
            if self.kind == "text":
                if not self.bar.disable:
                    self.bar.close()
            else:
                self._collapse()

    def _collapse(self) -> None:
        try:
            if self._handle is not None:
                from IPython.display import display

                from .htmlview import HTMLView

                page = f"<div class='tr-stats'>{self._stats_html()}</div>{self._answers_page(toggle=True)}"
                self._handle.update(HTMLView(page, self.summary()))
                display(self.figure())
        finally:
            for w in (self.plot, self.answers, self.toggle, self.stats, self.widget):
                w.close()
            self._handle = None
