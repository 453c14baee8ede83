"""Views (tokenrouter_sdk.viz): RunResult (list compatible, show/timeline/to_html), discarded
tokens, the trace reading behind the timeline, and the live view (text and widget kinds)."""

import io
import pickle
import re

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.engine.messages import Admitted, Committed, Finished, Hopped, StepDone
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.viz import LiveView, RunResult, TraceState
from tokenrouter_sdk.viz.tokens import PALETTE, token_pieces

from tests.helpers import mixed_prompts


@pytest.fixture(scope="module")
def run(pair, tok):
    """One routed run with handoffs and discarded tokens (RandomRouting discards on hops to large)."""
    with Router(pair, RandomRouting(p=0.3, seed=0), tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(4), max_new_tokens=24, ignore_eos=True)
        yield r, outs, r.metrics()


def test_generate_returns_list_compatible_run_result(run, tok):
    r, outs, m = run
    assert isinstance(outs, RunResult) and isinstance(outs, list) and len(outs) == 4
    assert outs == [o for o in outs] and r.last_run is outs
    assert all(len(o.token_ids) == 24 for o in outs)
    plain = pickle.loads(pickle.dumps(outs))
    assert type(plain) is list and [o.token_ids for o in plain] == [o.token_ids for o in outs]
    assert sum(o.hops for o in outs) == m.hops > 0


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
    assert {c for m, c in spans if m == "small"} == {PALETTE[0]} and {c for m, c in spans if m == "large"} == {PALETTE[1]}
    assert html.count('class="tr-disc"') == sum(o.discarded for o in outs)
    assert 'class="tr-toggle"' in html  # discarded tokens behind a checkbox
    shown = outs.show(discarded=True)._repr_html_()
    assert shown.count("display:inline;") == sum(o.discarded for o in outs) and "tr-toggle\"" not in shown
    text = repr(outs.show(0))
    assert text.startswith(f"req {outs[0].rid}: [") and text.count("[S:") + text.count("[L:") == len(outs[0].segments())


def test_timeline_bars_follow_ownership(run):
    r, outs, m = run
    fig = outs.timeline()
    names = [t.name for t in fig.data]
    assert names == ["small writes", "large writes", "pending on small", "pending on large",
                     "small batch", "small queue", "large batch", "large queue"]
    for o in outs:
        y = f"req {o.rid}"
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
    page = outs.to_html(tmp_path / "run.html")
    assert (tmp_path / "run.html").read_bytes().decode("utf-8") == page
    assert not re.search(r"<script[^>]*\ssrc=", page)  # nothing fetched: plotly.js is inline
    assert "plotly.js v" in page  # its banner
    assert len(page) > 1_000_000  # plotly.js itself (~4.5 MB) is in the page
    assert page.count('class="tr-tok"') == sum(len(o.token_ids) for o in outs) and 'id="tr-timeline"' in page


def test_trace_state_batch_queue_and_pending():
    st = TraceState(["small", "large"])
    st.feed([Admitted(0, None, 0.0), Admitted(1, None, 0.0),
             StepDone("small", 0.0, 1.0, 0.9, 1, 5, {0: 5}),  # req 1 waits: queue 1
             Committed(0, "small", [7], 1.0),
             Hopped(0, "small", "large", False, 1.0),
             StepDone("small", 1.0, 2.0, 0.9, 1, 3, {1: 3}),
             StepDone("large", 1.0, 2.0, 0.9, 1, 6, {0: 6}),
             Committed(0, "large", [8], 2.0), Committed(1, "small", [9], 2.0),
             Finished(0, "large", "length", None, 2.0), Finished(1, "small", "length", None, 3.0)])
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
        assert "display:inline;" not in html
        v.toggle.value = True  # the button shows the discarded tokens
        assert v.answers.value.count("display:inline;") == sum(o.discarded for o in outs) > 0
        own = sum(len(t.y) for t in v.fig.data[:2])
        assert own == sum(o.hops + 1 for o in outs)
        m = r.metrics()
        assert f"hop rate <b>{m.hop_rate:.3f}</b>" in v.stats.value and "3/3" in v.stats.value
        assert len(v.fig.data[4].x) == m.per_model["small"].steps
