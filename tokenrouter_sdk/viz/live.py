"""The live hop view behind ``Router.generate(..., live=True)``.

Design: no extra thread. The caller's thread, which would otherwise block until the requests
end, wakes every ``interval`` seconds (default 0.25 s: four updates per second), reads the
call's events appended since its last look (the engine appends them as sub-server events
arrive, from threads or, in process mode, from the pyzmq hub thread: the same events either
way) and the handles' growing outputs, and redraws. Generation never waits for the view.

In a notebook (an IPython kernel with ipywidgets): a stats line (committed tokens/s, hop rate,
large fraction), the answers as they are written with tokens coloured by model (a toggle shows
the discarded tokens), and a plotly ``FigureWidget``: per-request ownership / pending timeline
and per-model batch size and queue length. Elsewhere: a ``tqdm`` bar of finished requests with
the stats as its postfix and a final text summary.
"""

from __future__ import annotations

import sys
import time

from .figures import timeline_figure, update_figure
from .tokens import _piece_at, answer_html, page_html, token_pieces
from .trace import TraceState


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


class LiveView:
    """Follows one `Router.generate` call's requests and draws them while they run.

    Args:
        router: the `Router` (its tokenizer and models are read).
        handles: the call (`tokenrouter_sdk.engine.engine.Call`: its handles and events).
        kind: ``"auto"`` (widgets in a notebook, else text), ``"widget"`` or ``"text"``.
            ``"widget"`` outside a notebook builds and updates the widgets without displaying
            them (used to measure the view's cost).
        interval: seconds between redraws (throttle), > 0.
        max_share: the view's time budget as a share of wall time: after a redraw that took
            ``c`` seconds the next one waits at least ``c / max_share`` (default 0.03: a slow
            frontend redraws less often rather than slowing generation).
        out: stream of the text summary (default ``sys.stdout``).

    Raises:
        ValueError: unknown ``kind`` or ``interval <= 0``.
        ImportError: ``kind="widget"`` without ipywidgets / plotly / anywidget installed.
    """

    def __init__(self, router, handles, kind: str = "auto", interval: float = 0.25, out=None,
                 max_share: float = 0.03):
        if kind not in ("auto", "widget", "text"):
            raise ValueError(f"live view kind must be 'auto', 'widget' or 'text', got {kind!r}")
        if not interval > 0:
            raise ValueError(f"live view interval must be > 0 seconds, got {interval!r}")
        self.router, self.engine, self.handles = router, router.engine, list(handles)
        self.call = handles
        self.interval, self.out = interval, out
        self.displayed = in_notebook()
        self.kind = ("widget" if self.displayed else "text") if kind == "auto" else kind
        self.state = TraceState(list(router.models), {h.rid for h in self.handles},
                                {h.rid: h.entry for h in self.handles})
        self._pos = 0
        self._pieces: dict[int, list[str]] = {h.rid: [] for h in self.handles}
        self._html: dict[int, str] = {}
        self._dpieces: dict[int, list[str]] = {}
        self._n_seen: dict[int, tuple] = {}
        self.updates = 0
        self.update_s = 0.0
        self.max_share = max_share
        self.gap = interval
        self._build()
        router.last_view = self  # after the run: router.last_view.widget, .summary(), .update_s

    # -- frontends ------------------------------------------------------------------------
    def _build(self) -> None:
        if self.kind == "text":
            from tqdm.auto import tqdm
            self.bar = tqdm(total=len(self.handles), desc="requests", file=self.out, leave=True)
            return
        import ipywidgets as W
        self.stats = W.HTML()
        self.toggle = W.ToggleButton(value=False, description="show discarded tokens", icon="eye")
        self.answers = W.HTML(layout=W.Layout(max_height="360px", overflow="auto"))
        self.fig = timeline_figure(self.state, widget=True, title="starting")
        self.toggle.observe(lambda _change: self._redraw_answers(force=True), names="value")
        self.widget = W.VBox([self.stats, self.toggle, self.answers, self.fig])
        if self.displayed:
            from IPython.display import display
            display(self.widget)

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
                    raise TimeoutError(f"request {h.rid} did not finish within {timeout} s")
                self.engine.check_alive()
                if time.perf_counter() - last >= self.gap:
                    self.update()
                    last = time.perf_counter()
        self.update(final=True)

    def update(self, final: bool = False) -> None:
        """Read what is new in the trace and the outputs, and redraw."""
        t = time.perf_counter()
        with self.engine._lock:
            new = self.call.events[self._pos:]
            self._pos += len(new)
            snap = {h.rid: (list(h.output.token_ids), list(h.output.token_models), list(h.output.discarded_log),
                            h.output.finish_reason) for h in self.handles}
        self.state.feed(new)
        now = None if final else time.perf_counter()
        if self.kind == "text":
            s = self.state.stats(now)
            self.bar.n = s["finished"]
            self.bar.set_postfix_str(f"{s['tok_s']:.1f} tok/s, hop rate {s['hop_rate']:.3f}, "
                                     f"large {s['large_fraction']:.2f}", refresh=True)
            if final:
                self.bar.close()
                print(self.summary(), file=self.out or sys.stdout)
        else:
            self._snap = snap
            self._redraw_answers()
            s = self.state.stats(now)
            self.stats.value = (f"<b>{s['finished']}/{s['requests']}</b> requests · <b>{s['tok_s']:.1f}</b> "
                                f"committed tok/s · hop rate <b>{s['hop_rate']:.3f}</b> · large fraction "
                                f"<b>{s['large_fraction']:.2f}</b> · {s['discarded']} discarded · "
                                f"{s['elapsed_s']:.1f} s")
            update_figure(self.fig, self.state, now)
        self.updates += 1
        cost = time.perf_counter() - t
        self.update_s += cost
        self.gap = max(self.interval, cost / self.max_share)

    def _redraw_answers(self, force: bool = False) -> None:
        snap = getattr(self, "_snap", None)
        if snap is None:
            return
        tok, models = self.router.tokenizer, list(self.router.models)
        show = bool(self.toggle.value)
        for rid, (ids, token_models, log, reason) in snap.items():
            key = (len(ids), len(log), reason, show)
            if not force and self._n_seen.get(rid) == key:
                continue
            pieces = self._pieces[rid]
            if len(ids) > len(pieces):
                pieces.extend(token_pieces(tok, ids, start=len(pieces)))
            dpieces = self._dpieces.setdefault(rid, [])
            dpieces.extend(_piece_at(tok, ids, pos, t) for pos, t, _m in log[len(dpieces):])
            title = f"req {rid} · {reason or 'running'} · {len(pieces)} tokens"
            self._html[rid] = answer_html(pieces, token_models[:len(pieces)], models, log, dpieces, title,
                                          show_discarded=show)
            self._n_seen[rid] = key
        self.answers.value = page_html([self._html[r] for r in sorted(self._html)], models, toggle=False)

    def summary(self) -> str:
        """The final text summary: stats line and one line per model."""
        s = self.state.stats()
        lines = [f"{s['finished']}/{s['requests']} requests · {s['committed']} committed tokens in "
                 f"{s['elapsed_s']:.2f} s ({s['tok_s']:.1f} tok/s) · hop rate {s['hop_rate']:.3f} · "
                 f"large fraction {s['large_fraction']:.2f} · {s['discarded']} discarded"]
        for m in self.state.models:
            ser = self.state.series[m]
            mean_b = sum(ser.batch) / len(ser.batch) if ser.batch else 0.0
            lines.append(f"  {m}: {len(ser.t)} steps, mean batch {mean_b:.1f}, max queue "
                         f"{max(ser.queue, default=0)}, {self.state.tokens_by_model[m]} tokens written")
        return "\n".join(lines)

    def close(self) -> None:
        """Close the text bar (idempotent); a displayed widget stays on the page."""
        if self.kind == "text" and not self.bar.disable:
            self.bar.close()
