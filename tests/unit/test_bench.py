"""The throughput benchmark's matrix, ratios and outputs, on the sim backend."""

import csv

from tokenrouter_sdk.backends.sim_runner import LatencyModel
from tokenrouter_sdk.bench import format_table, run_bench, write_csv, write_html
from tokenrouter_sdk.models import tiny_tokenizer

LAT = {"small": LatencyModel({1: 0.024, 8: 0.039, 16: 0.051}), "large": LatencyModel({1: 0.064, 8: 0.110, 16: 0.158})}


def test_bench_matrix_ratios_and_files(tmp_path):
    cells = run_bench(
        LAT,
        tiny_tokenizer(),
        [[5] * 20, [9] * 33],
        policies=("random10",),
        concurrency=(1, 4),
        max_new_tokens=(32,),
        thresholds="small=2,large=2",
        backend="sim",
        progress=False,
    )
    # 4 modes x 2 concurrencies + retain_kv=False for async and delayed + large-only and small-only
    assert len(cells) == 4 * 2 + 2 * 2 + 2 * 2
    by = {(c.policy, c.mode, c.retain_kv, c.concurrency): c for c in cells}
    for n in (1, 4):
        assert by[("random10", "sync", True, n)].vs_sync == 1.0
        a, d = by[("random10", "async", True, n)], by[("random10", "async", False, n)]
        assert a.vs_no_retain == a.throughput_tok_s / d.throughput_tok_s > 1.0
        assert all(c.committed_tokens == 2 * n * 32 for c in cells if c.concurrency == n)
    assert by[("random10", "delayed", True, 4)].thresholds == "small=2,large=2"
    assert 0.0 < by[("random10", "async", True, 4)].large_fraction < 0.3
    assert by[("large_only", "async", True, 4)].large_fraction == 1.0
    write_csv(cells, tmp_path / "b.csv")
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert len(rows) == len(cells) and float(rows[0]["throughput_tok_s"]) == cells[0].throughput_tok_s
    assert write_html(cells, tmp_path / "b.html") and "plotly" in (tmp_path / "b.html").read_text()[:5000].lower()
    assert "random10" in format_table(cells)


def test_max_routers_bounds_the_routers_open_at_once(monkeypatch):
    import tokenrouter_sdk.router as router_mod

    opened, peak = [], []

    class Counting(router_mod.Router):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            opened.append(self)
            peak.append(sum(not r.closed for r in opened))

    monkeypatch.setattr(router_mod, "Router", Counting)
    cells = [("random10", m, True, 2, 8) for m in ("sync", "async", "sync", "delayed", "delayed")]
    kw = dict(cells=cells, thresholds="small=1,large=1", backend="sim", progress=False)
    out = run_bench(LAT, tiny_tokenizer(), [[5] * 20], max_routers=1, **kw)
    assert [c.mode for c in out] == [c[1] for c in cells] and all(c.committed_tokens == 32 for c in out)
    assert len(opened) == 4 and max(peak) == 1  # sync reopened after async; delayed reused
    assert all(r.closed for r in opened)
    opened.clear(), peak.clear()
    run_bench(LAT, tiny_tokenizer(), [[5] * 20], **kw)  # default: every Router stays open to the end
    assert len(opened) == 3 and max(peak) == 3


def test_a_cell_whose_requests_fail_says_so():
    from tokenrouter_sdk import Policy
    from tokenrouter_sdk.policies.registry import PolicyRegistry

    class Boom(Policy):
        def route(self, step):
            raise RuntimeError("boom")

    cells = run_bench(
        LAT,
        tiny_tokenizer(),
        [[5] * 20],
        cells=[("boom", "async", True, 2, 4)],
        backend="sim",
        progress=False,
        registry=PolicyRegistry({"boom": Boom}),
    )
    assert cells[0].failed == 4
    assert "FAILED requests in 1 cell(s)" in format_table(cells) and "4 !" in format_table(cells)


def test_each_cell_says_where_its_time_went(tmp_path):
    import json

    from tokenrouter_sdk.bench import format_accounting

    cells = run_bench(
        LAT,
        tiny_tokenizer(),
        [[5] * 20, [9] * 33],
        policies=("random30",),
        modes=("async",),
        concurrency=(4,),
        max_new_tokens=(32,),
        backend="sim",
        progress=False,
    )
    by = {(c.policy, c.retain_kv): c for c in cells}
    routed, large = by[("random30", True)], by[("large_only", True)]
    for c in cells:
        for a in c.accounting.values():
            assert sum(a["batch_hist"].values()) == a["steps"] == a["decode_steps"] + a["mixed_steps"]
            assert sum(b * k for b, k in a["batch_hist"].items()) == round(a["mean_batch"] * a["steps"])
            assert a["forward_s"] <= a["step_s"] + 1e-9 and a["step_s"] <= c.wall_s * 1.01
    assert large.accounting["small"]["steps"] == 0 and large.accounting["large"]["steps"] > 0
    # every committed token is fed once on its writer's model; a routed request's hand-offs add
    # extends (the unseen tokens) on the receiving model
    assert large.accounting["large"]["tokens_fed"] >= large.committed_tokens
    assert routed.accounting["large"]["mixed_steps"] > 0 and routed.accounting["large"]["mixed_fed"] > 0
    text = format_accounting(cells)
    assert "random30 async keep N=4 [large] steps" in text and "busy" in text
    write_csv(cells, tmp_path / "b.csv")
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert {
        k: {int(b): n for b, n in v["batch_hist"].items()} for k, v in json.loads(rows[0]["accounting"]).items()
    } == {k: v["batch_hist"] for k, v in cells[0].accounting.items()}
