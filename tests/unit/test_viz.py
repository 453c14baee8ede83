"""Views (tokenrouter_sdk.viz): RunResult (list compatible, show/timeline/to_html, pickling,
notebook tables), discarded tokens, the trace reading behind the timeline, figures that carry an
HTML form, the live view (text and widget kinds, the fallback without ipywidgets, what it keeps
after the run) and the notebook forms of Metrics and KV stats."""

import gc
import io
import json
import pickle
import re
import sys
import threading
import time
import weakref

import pytest

from tests.helpers import interrupt_main_after, mixed_prompts
from tokenrouter_sdk import Router
from tokenrouter_sdk.engine.messages import Admitted, Committed, Finished, Hopped, StepDone
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.result import RunResult
from tokenrouter_sdk.viz import LiveView, TraceState
from tokenrouter_sdk.viz.tokens import PALETTE, token_pieces

PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.fixture(scope="module")
def run(pair, tok):
    """One routed run with handoffs and discarded tokens (RandomRouting discards on hops to large),
    after a first call: its request ids (Router-wide) differ from its indices in the call."""
    with Router(pair, RandomRouting(p=0.3, seed=0), tokenizer=tok) as r:
        r.generate(mixed_prompts(2, seed=9), max_new_tokens=2)
        outs = r.generate(mixed_prompts(4), max_new_tokens=24, ignore_eos=True)
        assert [o.rid for o in outs] == [2, 3, 4, 5] and [o.index for o in outs] == [0, 1, 2, 3]
        yield r, outs, r.metrics()


def test_generate_returns_list_compatible_run_result(run, tok):
    r, outs, m = run
    assert isinstance(outs, RunResult) and isinstance(outs, list) and len(outs) == 4
    assert outs == [o for o in outs] and r.last_run is outs
    assert all(len(o.token_ids) == 24 for o in outs)
    assert sum(o.hops for o in outs) == m.hops > 0


def test_pickled_run_keeps_its_class_events_and_views(run):
    r, outs, m = run
    data = pickle.dumps(outs)
    back = pickle.loads(data)
    assert type(back) is RunResult and back == list(outs) and back.tokenizer is None
    assert back.trace == outs.trace and back.models == outs.models
    # it draws itself without a tokenizer, from the decoded pieces it carried
    strip = lambda h: re.sub(r"tr-toggle-[0-9a-f]+", "tr-toggle", h)  # noqa: E731 - fresh checkbox ids
    assert strip(back.show().html) == strip(outs.show().html) and repr(back.show()) == repr(outs.show())
    assert back.summary() == outs.summary() and back.metrics() == m
    assert [t.y for t in back.timeline().data] == [t.y for t in outs.timeline().data]
    assert pickle.loads(pickle.dumps(back)).show().html.count('class="tr-tok"') == sum(len(o.token_ids) for o in outs)
    import copy

    assert copy.copy(outs).tokenizer is r.tokenizer and type(copy.deepcopy(outs)) is RunResult
    with pytest.raises(ValueError, match="tokenizer"):
        RunResult(list(outs)).show()


def test_discarded_log_matches_counts_and_positions(run):
    _, outs, m = run
    assert sum(len(o.discarded_log) for o in outs) == sum(o.discarded for o in outs) == m.discarded_tokens > 0
    for o in outs:
        for pos, tok_id, model in o.discarded_log:
            assert 0 <= pos < len(o.token_ids) and isinstance(tok_id, int)
            assert o.token_models[pos] != model  # the peer wrote that position instead


def test_show_colours_every_committed_token(run):
    r, outs, _ = run
    view = outs.show()
    html = view._repr_html_()
    spans = re.findall(r'<span class="tr-tok" data-model="(\w+)"[^>]*style="background:([^"]+)"', html)
    assert len(spans) == sum(len(o.token_ids) for o in outs)
    want = [m for o in outs for m in o.token_models]
    assert [m for m, _ in spans] == want
    assert {c for m, c in spans if m == "small"} == {PALETTE[0]} and {c for m, c in spans if m == "large"} == {
        PALETTE[1]
    }
    assert html.count('class="tr-disc"') == sum(o.discarded for o in outs)
    assert 'class="tr-toggle"' in html  # discarded tokens behind a checkbox
    shown = outs.show(discarded=True)._repr_html_()
    assert shown.count("display:inline;") == sum(o.discarded for o in outs) and 'tr-toggle"' not in shown
    text = repr(outs.show(0))
    assert text.startswith("req 0: [") and text.count("[S:") + text.count("[L:") == len(outs[0].segments())


def test_views_label_requests_by_their_index_in_the_call(run):
    _, outs, _ = run
    heads = re.findall(r'<div class="tr-head">req (\d+) ', outs.show().html)
    assert heads == ["0", "1", "2", "3"]  # not the Router-wide ids 2..5
    assert re.findall(r"(?m)^req (\d+):", repr(outs.show())) == ["0", "1", "2", "3"]
    rows = [y for t in outs.timeline().data[:2] for y in t.y]
    assert set(rows) == {"req 0", "req 1", "req 2", "req 3"}


def test_timeline_bars_follow_ownership(run):
    r, outs, m = run
    fig = outs.timeline()
    names = [t.name for t in fig.data]
    assert names == [
        "small writes",
        "large writes",
        "pending on small",
        "pending on large",
        "small batch",
        "small queue",
        "large batch",
        "large queue",
    ]
    for o in outs:
        y = f"req {o.index}"
        own = [(b, w) for t in fig.data[:2] for yy, b, w in zip(t.y, t.base, t.x) if yy == y]
        assert len(own) == o.hops + 1  # one bar per owner segment
        assert sum(w for _, w in own) == pytest.approx(o.latency_s, abs=1e-6)
    st = outs.state()
    for name in ("small", "large"):
        assert len(st.series[name].t) == m.per_model[name].steps
        batch = fig.data[names.index(f"{name} batch")].y
        assert sorted(set(int(b) for b in batch)) == sorted(m.per_model[name].batch_size_hist)
    s = st.stats()
    assert s["hop_rate"] == pytest.approx(m.hop_rate) and s["large_fraction"] == pytest.approx(m.large_fraction)
    assert s["committed"] == m.committed_tokens


def test_to_html_inlines_plotly(run, tmp_path):
    _, outs, _ = run
    written = outs.to_html(tmp_path / "run.html")
    assert written == tmp_path / "run.html"  # the path, not the 4.5 MB page, ends a notebook cell
    page = written.read_bytes().decode("utf-8")
    assert outs.to_html().startswith("<!doctype html>")  # without a path: the page itself
    assert not re.search(r"<script[^>]*\ssrc=", page)  # nothing fetched: plotly.js is inline
    assert "plotly.js v" in page  # its banner
    assert len(page) > 1_000_000  # plotly.js itself (~4.5 MB) is in the page
    assert page.count('class="tr-tok"') == sum(len(o.token_ids) for o in outs) and 'id="tr-timeline"' in page


def test_trace_state_batch_queue_and_pending():
    st = TraceState(["small", "large"])
    st.feed(
        [
            Admitted(0, None, 0.0),
            Admitted(1, None, 0.0),
            # req 1 waits: queue 1
            StepDone(model="small", t_start=0.0, t_end=1.0, forward_s=0.9, batch_size=1, tokens_fed=5, fed={0: 5}),
            Committed(0, "small", [7], 1.0),
            Hopped(0, "small", "large", False, 1.0),
            StepDone(model="small", t_start=1.0, t_end=2.0, forward_s=0.9, batch_size=1, tokens_fed=3, fed={1: 3}),
            StepDone(model="large", t_start=1.0, t_end=2.0, forward_s=0.9, batch_size=1, tokens_fed=6, fed={0: 6}),
            Committed(0, "large", [8], 2.0),
            Committed(1, "small", [9], 2.0),
            Finished(0, "large", "length", None, 2.0),
            Finished(1, "small", "length", None, 3.0),
        ]
    )
    assert st.series["small"].batch == [1, 1] and st.series["small"].queue == [1, 0]
    assert st.series["large"].batch == [1] and st.series["large"].queue == [0]
    bars = st.bars()
    assert bars[("own", "small")][0] == ["req 0", "req 1"] and bars[("own", "large")][0] == ["req 0"]
    assert bars[("own", "large")][1:3] == ([1.0], [1.0])
    assert bars[("pending", "small")][0] == ["req 0"]  # while large writes, small keeps req 0's KV
    s = st.stats()
    assert (s["committed"], s["hops"], s["discarded"], s["finished"]) == (3, 1, 1, 2)
    assert s["tok_s"] == pytest.approx(1.0) and s["large_fraction"] == pytest.approx(1 / 3)


def test_token_pieces_multibyte(tok):
    b = "é".encode()
    ids = [ord("a"), b[0], b[1], ord(" "), ord("b")]
    assert token_pieces(tok, ids) == ["a", "", "é", " ", "b"]
    assert "".join(token_pieces(tok, ids, start=2)) == "é b"


def test_live_text_same_tokens_and_summary(pair, tok):
    prompts = mixed_prompts(3, seed=4)
    buf = io.StringIO()
    with Router(pair, RandomRouting(p=0.3, seed=1), tokenizer=tok) as r:  # same rids, same draws
        plain = r.generate(prompts, max_new_tokens=16, ignore_eos=True)
    with Router(pair, RandomRouting(p=0.3, seed=1), tokenizer=tok) as r:
        outs = r.generate(prompts, max_new_tokens=16, ignore_eos=True, live="text")
        v = r.last_view
        assert isinstance(v, LiveView) and v.kind == "text" and v.updates >= 1
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        summary = v.summary()
        m = r.metrics()
        assert f"hop rate {m.hop_rate:.3f}" in summary and "3/3 requests" in summary
        assert f"{m.committed_tokens} committed tokens" in summary
        v2 = LiveView(r, [], kind="text", out=buf)
        v2.close()
    with pytest.raises(ValueError, match="kind"):
        LiveView(r, [], kind="browser")
    with pytest.raises(ValueError, match="interval"):
        LiveView(r, [], kind="text", interval=0)


def test_live_widget_updates_figure_and_answers(pair, tok):
    with Router(pair, RandomRouting(p=0.3, seed=2), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(3, seed=5), max_new_tokens=20, ignore_eos=True, live="widget")
        v = r.last_view
        assert v.kind == "widget" and not v.displayed and v.updates >= 1
        html = v.answers.value
        assert html.count('class="tr-tok"') == 60 and html.count('class="tr-disc"') == sum(o.discarded for o in outs)
        assert sum(o.discarded for o in outs) > 0 and "display:inline;" not in html
        # the checkbox is pure CSS (works while the kernel is busy): it un-hides .tr-disc in this view only
        assert f".{v.css_class}:has(input.tr-toggle:checked) .tr-disc{{display:inline}}" in v.toggle.value
        assert v.css_class in v.widget._dom_classes
        # the last redraw of the timeline: plotly JSON (no plotly.js) with an HTML form
        (plot,) = v.plot.outputs
        spec = plot["data"][PLOTLY_MIME]
        assert sum(len(t["y"]) for t in spec["data"][:2]) == sum(o.hops + 1 for o in outs)
        assert "Plotly.newPlot" in plot["data"]["text/html"] and len(json.dumps(plot)) < 60_000
        m = r.metrics()
        assert f"hop rate <b>{m.hop_rate:.3f}</b>" in v.stats.value and "3/3" in v.stats.value
        assert len(spec["data"][4]["x"]) == m.per_model["small"].steps
        fig = v.figure()
        assert [t.y for t in fig.data] == [tuple(t["y"]) for t in spec["data"]]


def test_live_view_keeps_nothing_of_the_router(pair, tok):
    """After the run the view, the result, its figures and tables hold no Router, engine or
    sub-server: dropping the Router frees them at once (no gc cycle), and the view's widgets are
    closed (ipywidgets' registry, like a kernel's comms, would otherwise keep them)."""
    import ipywidgets

    before = set(threading.enumerate())
    r = Router(pair, RandomRouting(p=0.3, seed=2), tokenizer=tok)
    outs = r.generate(mixed_prompts(3, seed=5), max_new_tokens=12, ignore_eos=True, live="widget")
    v = r.last_view
    keep = (outs, v, v.figure(), outs.show(), outs.timeline(), outs.metrics(), r.metrics(), r.kv_stats())
    assert v.router is None and v.call is None and v.handles is None
    widgets = (v.widget, v.stats, v.toggle, v.answers, v.plot)
    live = list(ipywidgets.widgets.widget._instances.values())
    assert all(w.comm is None and not any(w is x for x in live) for w in widgets)
    engine, threads = weakref.ref(r.engine), set(threading.enumerate()) - before
    router = weakref.ref(r)
    gc.disable()  # the Router is freed by reference counting, not by a later collection
    try:
        del r
        assert router() is None  # its finalizer closed the engine: the engine's threads end
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads)
    finally:
        gc.enable()
    gc.collect()  # the engine's own reference cycles (transport callbacks, calls)
    assert engine() is None and len(keep) == 8


def _slow_policy(delay_s):
    from tokenrouter_sdk import Policy

    class Slow(Policy):
        def route(self, step):
            time.sleep(delay_s)
            return step.model

    return Slow()


@pytest.mark.parametrize("live", [False, "widget", "text"])
def test_interrupted_generate_leaves_no_router_in_the_traceback(pair, tok, live):
    """Ctrl-C in a notebook: the kernel keeps the traceback (sys.last_traceback); its frames must
    not keep the Router (and its engine) alive."""
    r = Router(pair, _slow_policy(0.01), tokenizer=tok)
    router, engine = weakref.ref(r), weakref.ref(r.engine)
    with interrupt_main_after(0.3) as timer, pytest.raises(KeyboardInterrupt) as info:
        r.generate(mixed_prompts(2), max_new_tokens=200, ignore_eos=True, live=live)
        time.sleep(5)  # not reached: the interrupt lands in generate
    timer.join()
    outs = r.last_run
    assert [o.finish_reason for o in outs] == ["aborted", "aborted"]
    tb = info.value.__traceback__
    assert tb is not None
    gc.collect()
    del r
    gc.collect()
    assert router() is None and engine() is None, [type(x).__name__ for x in gc.get_referrers(router())][:5]
    assert tb is info.value.__traceback__


def test_live_auto_falls_back_to_text_without_widgets(pair, tok, monkeypatch, capsys):
    """In a notebook without ipywidgets (its import fails), live=True prints a one-line notice and
    shows the text view instead of raising ImportError."""
    import tokenrouter_sdk.viz.live as live_mod

    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # `import ipywidgets` raises ImportError
    monkeypatch.setattr(live_mod, "in_notebook", lambda: True)
    with Router(pair, RandomRouting(p=0.3, seed=1), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(2, seed=4), max_new_tokens=8, ignore_eos=True, live=True)
        v = r.last_view
    out = capsys.readouterr().out
    notice = [line for line in out.splitlines() if line.startswith("live view:")]
    assert notice == [
        "live view: ipywidgets is not installed, showing the text view (pip install "
        "'tokenrouter-sdk[viz]' for the notebook view)"
    ]
    assert v.kind == "text" and v.fallback == "ipywidgets" and "2/2 requests" in out
    assert all(len(o.token_ids) == 8 for o in outs)
    with Router(pair, tokenizer=tok) as r, pytest.raises(ImportError):
        r.generate([[5, 6]], max_new_tokens=2, live="widget")  # asked for by name: the error stays


def test_figures_carry_plotly_json_and_html_without_plotlyjs(run):
    from plotly.offline import get_plotlyjs_version

    _, outs, _ = run
    fig = outs.timeline()
    bundle = fig._repr_mimebundle_()
    assert set(bundle) == {PLOTLY_MIME, "text/html", "text/plain"}
    assert bundle[PLOTLY_MIME]["data"][0]["name"] == "small writes"
    html = bundle["text/html"]
    assert "Plotly.newPlot" in html and f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js" in html
    assert "window.TOKENROUTER_PLOTLYJS" in html and len(html) < 100_000  # plotly.js (4.8 MB) is not in it
    assert "</script" not in html[html.index("<script") : -len("</script>")]
    assert "Plotly.newPlot" in fig._repr_html_()
    fig.update_layout(title="x")  # still a plotly Figure
    assert type(fig).__name__ == "NotebookFigure" and fig.layout.title.text == "x"


def test_notebook_tables_of_metrics_run_and_kv_stats(pair, tok):
    with Router(pair, RandomRouting(p=0.3, seed=3), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(3, seed=2), max_new_tokens=10, ignore_eos=True)
        m = r.metrics()
        kv = r.kv_stats()
    text = repr(m)
    assert text.startswith("Metrics of 3 requests") and "\nthroughput_tok_s" in text and "[small] steps=" in text
    assert len(text.splitlines()) == 1 + 17 + 2  # header, run-level fields, one line per model
    h = m._repr_html_()
    assert h.count("<table") == 2 and "<td style='text-align:left'>hop_rate</td>" in h
    assert f"<td style='text-align:right'>{m.committed_tokens}</td>" in h and ">large<" in h
    rtext = repr(outs)
    assert rtext.startswith("RunResult of 3 requests: 3/3 requests") and len(rtext.splitlines()) == 2 + 3
    rh = outs._repr_html_()
    assert rh.count("<tr>") == 1 + 3 and ".timeline()" in rh and "<th style='text-align:left'>text</th>" in rh
    assert isinstance(kv, dict) and set(kv) == {"small", "large"} and kv["small"].alive
    kh = kv._repr_html_()
    assert kh.count("<tr>") == 3 and f">{kv['large'].num_blocks}<" in kh
    assert repr(kv).splitlines()[1].split()[:3] == ["model", "alive", "used_blocks"]


def test_eval_result_table_and_plot_survive_export():
    from tokenrouter_sdk.eval.result import EvalResult

    rec = dict(
        label="tau=0.1",
        kind="sweep",
        policy="RStitch",
        param="tau",
        value=0.1,
        n=4,
        correct=2,
        accuracy=0.5,
        acc_ci_low=0.15,
        acc_ci_high=0.85,
        agreement=0.75,
        hop_rate=0.05,
        large_fraction=0.3,
        throughput_tok_s=12.5,
        mean_latency_s=1.5,
        tokens_per_answer=40.0,
    )
    ref = dict(rec, label="large_only", kind="large_only", value=None, accuracy=0.75, throughput_tok_s=8.0)
    res = EvalResult([rec, ref], {"dataset": {"name": "gsm8k", "n": 4}})
    h = res._repr_html_()
    assert h.count("<tr>") == 3 and "<td style='text-align:left'>tau=0.1</td>" in h and "[0.15,0.85]" in h
    bundle = res.plot()._repr_mimebundle_()
    assert {PLOTLY_MIME, "text/html"} <= set(bundle) and "Plotly.newPlot" in bundle["text/html"]
