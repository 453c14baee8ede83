"""The few-row projection kernel (``csrc/skinny_gemm.cpp``): equal to a matmul at every row count
and shape, bias and residual included; bad input refused by name; measured beside the oneDNN
and plain paths, stored with its timings (an entry measured without it is measured again once it
is there), forced by ``TOKENROUTER_PACKING=skinny``, and a runner's steps through it give the
logits of the transformers forward. Its prefetch locality changes no bit; the faster one is
measured once per machine, stored, read back, forced by ``TOKENROUTER_SKINNY_PREFETCH``, and a
broken or foreign entry is measured again."""

import json
import sys

import pytest
import torch

from tokenrouter_sdk.backends import autotune as A
from tokenrouter_sdk.backends import cpu_kernels
from tokenrouter_sdk.backends import projection as P
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model

pytestmark = pytest.mark.skipif(
    not P.packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN packing in this torch"
)


@pytest.fixture(scope="module")
def ops():
    assert cpu_kernels.paged_attention_op(wait=True, timeout=600) is not None, cpu_kernels.error()
    return torch.ops.tokenrouter_cpu


@pytest.fixture
def store(ops, tmp_path, monkeypatch):
    """An empty extension root for the choices (the kernels are loaded already) and no forced choice."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(A.CHOICES_ENV, raising=False)  # the store is this extension root's
    monkeypatch.delenv(A.PACKING_ENV, raising=False)
    monkeypatch.delenv(A.PREFETCH_ENV, raising=False)
    return tmp_path


@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (17, 3), (16, 1)])
def test_the_kernel_equals_a_matmul_at_every_row_count(ops, n, k):
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    wp = ops.skinny_pack(w)
    assert wp.shape == (-(-n // 32), k, 32)
    for m in (1, 2, 7, 8, 9, 15, 16, 17, 40):
        x, r = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
        want = x.double() @ w.double().T
        torch.testing.assert_close(ops.skinny_linear(x, wp, n).double(), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(
            ops.skinny_linear(x, wp, n, b, r).double(), want + b.double() + r.double(), rtol=1e-5, atol=1e-4
        )
        wide = torch.randn(m, n + 5, generator=g)[:, :n]  # a residual with a row stride of its own
        torch.testing.assert_close(
            ops.skinny_linear(x, wp, n, None, wide).double(), want + wide.double(), rtol=1e-5, atol=1e-4
        )


def _mapped(addr: int) -> bool:
    """Whether ``addr`` lies in one of this process's mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge-page mappings are Linux's")
def test_a_large_packed_weight_lives_on_a_huge_page_boundary(ops):
    """A packed weight of 2 MiB or more gets its own 2 MiB-aligned mapping advised for huge
    pages (smaller ones, torch's allocator); either gives the matmul, and the mapping goes when
    the tensor does."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1030, 576, generator=g)  # 33 blocks x 576 x 32 floats: 2.4 MB
    wp = ops.skinny_pack(w)
    assert wp.data_ptr() % (2 << 20) == 0
    assert torch.count_nonzero(wp[-1, :, 6:]) == 0  # the padding past N is zero
    x = torch.randn(8, 576, generator=g)
    torch.testing.assert_close(ops.skinny_linear(x, wp, 1030).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)
    ptr = wp.data_ptr()
    assert _mapped(ptr)
    del wp
    assert not _mapped(ptr)  # unmapped with the tensor
    assert ops.skinny_pack(torch.randn(32, 8)).data_ptr() % 64 == 0  # small: torch's allocator


def test_bad_input_is_refused_by_name(ops):
    wp = ops.skinny_pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="x must be a 2-D float32"):
        ops.skinny_linear(torch.randn(2, 8, dtype=torch.float64), wp, 32)
    with pytest.raises(RuntimeError, match="packed weight does not fit"):
        ops.skinny_linear(torch.randn(2, 9), wp, 32)
    with pytest.raises(RuntimeError, match="the weight must be a 2-D float32"):
        ops.skinny_pack(torch.randn(4, 4, dtype=torch.float64))


def _runner(seed=5, kernels="wait"):
    model = tiny_model(num_layers=3, seed=seed, dtype=torch.float32)
    return TorchRunner(model, max_kv_tokens=256, kernels=kernels)


def _step(runner, ids):
    table: list[int] = []
    blocks_of(runner).ensure(table, len(ids))
    return runner.forward([SeqInput(ids, 0, table)])


def test_forced_skinny_runs_the_kernel_and_gives_the_logits_of_the_transformers_forward(store, monkeypatch):
    monkeypatch.setenv(A.PACKING_ENV, "skinny")
    monkeypatch.setenv(A.PREFETCH_ENV, "2")  # forced too: nothing is measured, so every kernel call is a step's
    monkeypatch.setenv("TOKENROUTER_FUSED_LAYERS", "0")  # the layer loop, whose projection calls are counted here
    runner = _runner()
    calls = []
    orig = P.Projection.run_skinny
    monkeypatch.setattr(
        P.Projection, "run_skinny", lambda self, x, r=None, **kw: calls.append(x.shape[0]) or orig(self, x, r, **kw)
    )
    ref = TorchRunner(runner.model, max_kv_tokens=256, model_impl="transformers", kernels="off")
    for ids in ([5, 6, 7], list(range(3, 23))):  # 3 rows, then 20 (two chunks of rows)
        calls.clear()
        out = _step(runner, ids)
        projs = runner._native.projections
        assert all(
            p.path(len(ids)) == "skinny" and p.skinny is not None and p.prefetch == A.Prefetch(2, 2) for p in projs
        )
        assert calls.count(len(ids)) == 4 * 3 and set(calls) <= {len(ids), 1}  # 4 per layer; the head: 1 row
        want = _step(ref, ids)
        torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=1e-5)
        assert out.logits.argmax(-1).tolist() == want.logits.argmax(-1).tolist()
    stored = A.load_choices(A.machine_fields())  # forced: no path or prefetch measured, none stored
    assert not any(k.startswith(("packing", A.PREFETCH_KEY)) for k in stored)


class FakeMeasure:
    """Skinny wins up to ``upto`` rows (when it is a candidate), packed above; counts groups."""

    def __init__(self, upto=8):
        self.upto, self.calls, self.with_skinny = upto, [], []

    def __call__(self, projs):
        self.calls.append(A.group_key(projs[0]))
        fast = all(p.skinny is not None for p in projs)
        self.with_skinny.append(fast)
        n = len(A.BUCKETS)
        out = {
            "buckets": list(A.BUCKETS),
            "packed": [True] * n,
            "packed_ms": [1.0] * n,
            "plain_ms": [2.0] * n,
            "layers": len(projs),
        }
        if fast:
            out.update(skinny=[b <= self.upto for b in A.BUCKETS], skinny_ms=[0.5] * n)
        return out


def _packed_projections() -> list:
    """The projections of a runner built without the kernels and without measuring (packed)."""
    runner = _runner(kernels="off")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(A.PACKING_ENV, "packed")
        _step(runner, [5, 6, 7])
    return runner._native.projections


def test_an_entry_measured_without_the_kernel_is_measured_again_once_it_is_there(store, ops):
    projs = _packed_projections()
    fields = A.machine_fields()
    first = FakeMeasure()
    A.tune_packing(projs, measure=first, fields=fields)  # no kernel weights yet
    assert first.calls and not any(first.with_skinny)
    assert all(p.path(1) == "packed" for p in projs)
    assert all(p.add_skinny(ops) for p in projs)
    again = FakeMeasure(upto=8)
    rules = A.tune_packing(projs, measure=again, fields=fields)
    assert sorted(again.calls) == sorted(first.calls) and all(again.with_skinny)
    assert all(p.path(8) == "skinny" and p.path(16) == "packed" for p in projs)
    assert all(r.describe() == "skinny at 1-8, packed at 16-128 rows" for r in rules.values())
    stored = json.loads(A.choices_path(fields).read_text())["choices"]
    assert all("skinny_ms" in e for k, e in stored.items() if k.startswith("packing"))
    assert all(
        h in A.PREFETCH_HINTS for h in stored[A.prefetch_key(projs)]["chosen"]
    )  # measured once the kernel was there
    cached = FakeMeasure(upto=1)
    A.tune_packing(projs, measure=cached, fields=fields)
    assert cached.calls == [] and all(p.path(8) == "skinny" for p in projs)


def test_a_rule_that_never_runs_the_kernel_drops_its_weights(store, ops):
    projs = _packed_projections()
    assert all(p.add_skinny(ops) for p in projs)
    A.tune_packing(projs, measure=FakeMeasure(upto=0), fields=A.machine_fields())
    assert all(p.skinny is None and p.path(1) == "packed" for p in projs)


def test_a_measurement_survives_the_kernel_weights_dropped_meanwhile(store, ops, monkeypatch):
    """Two runners sharing layers (a model and its self-draft, built in threads of one process)
    tune the same projections: one may drop the kernel's weights while the other times them.
    The timing runs on the weights it started with."""
    projs = _packed_projections()
    projs = [p for p in projs if A.group_key(p) == A.group_key(projs[0])]  # one group: one shape
    assert all(p.add_skinny(ops) for p in projs)
    orig = P.Projection.run_packed

    def run_packed_then_drop(self, x):
        for p in projs:  # the other runner's rule never runs the kernel: it drops the weights
            p.skinny = None
        return orig(self, x)

    monkeypatch.setattr(P.Projection, "run_packed", run_packed_then_drop)
    out = A.measure_group(projs, buckets=(1, 8), reps=1)
    assert len(out["skinny_ms"]) == 2 and all(v > 0 for v in out["skinny_ms"])


def test_a_step_runs_on_the_kernel_weights_it_chose_even_if_they_are_dropped_meanwhile(store, ops, monkeypatch):
    """A runner steps while another sharing its layers drops the kernel's weights (its rule
    never runs them): a projection that chose the kernel for this step runs it on the weights
    it read, and gives the matmul."""
    monkeypatch.setenv(A.PACKING_ENV, "skinny")
    projs = _packed_projections()
    A.tune_packing(projs, fields=A.machine_fields())
    p = projs[0]

    class DroppedOnceRead(type(p)):
        """The other runner drops ``skinny`` right after this step first reads it."""

        @property
        def skinny(self):
            w, self.__dict__["_w"] = self.__dict__.get("_w"), None
            return w

        @skinny.setter
        def skinny(self, w):
            self.__dict__["_w"] = w

    p.__class__ = DroppedOnceRead
    x = torch.randn(2, p.mods[0].weight.shape[1])
    want = x.double() @ p._merged_weight().double().T
    for call in (lambda: torch.cat(p(x), -1), lambda: p.merged(x)):
        p.skinny = ops.skinny_pack(p._merged_weight())
        torch.testing.assert_close(call().double(), want, rtol=1e-5, atol=1e-4)
        assert p.skinny is None


def test_a_tune_that_began_without_the_kernel_leaves_what_a_tune_with_it_set_meanwhile(store, ops, monkeypatch):
    """The other order: a runner tunes from a stored entry measured without the kernel while the
    runner sharing its layers adds the kernel's weights and tunes with them. The first must
    neither drop those weights nor put back its rule without the kernel."""
    projs = _packed_projections()
    fields = A.machine_fields()
    A.tune_packing(projs, measure=FakeMeasure(), fields=fields)  # stored without the kernel
    orig, done = A._rule_of, []

    def rule_of(entry, skinny=False):
        if not done:  # meanwhile, the other runner
            done.append(True)
            assert all(p.add_skinny(ops) for p in projs)
            A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=fields)
        return orig(entry, skinny)

    monkeypatch.setattr(A, "_rule_of", rule_of)
    A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=fields)
    assert done and all(p.skinny is not None and p.path(8) == "skinny" for p in projs)


def test_the_kernel_is_chosen_within_a_margin_or_a_slack_a_projection():
    """A pass of 30 small projections 0.05 ms (5.2%) slower than MKL's (about 2 us a projection,
    where one call for a layer saves tens) takes the kernel; 1.5 ms slower does not; a large
    pass takes it within 5%."""
    assert A.skinny_edge(0.97, 30) >= 1.02 and A.skinny_edge(0.97, 30) < 0.97 + 1.5
    assert A.skinny_edge(0.97, 30) == pytest.approx(0.97 + 30 * A.SKINNY_SLACK_MS)
    assert A.skinny_edge(100.0, 30) == pytest.approx(105.0)
    assert A.skinny_edge(100.0, 30) < 105.1


def test_a_runner_measures_the_kernel_for_real_and_stores_its_timings(store, capsys):
    runner = _runner(kernels="wait")
    _step(runner, [5, 6, 7])
    assert A.machine_fields()["kernels"] == cpu_kernels.build_name()  # a changed kernel is measured again
    entries = {k: e for k, e in A.load_choices(A.machine_fields()).items() if k.startswith("packing")}
    assert entries and all(
        len(e["skinny_ms"]) == len(e["buckets"]) and all(v > 0 for v in e["skinny_ms"]) for e in entries.values()
    )
    for e in entries.values():  # the choice was made on unrounded times, stored rounded to 0.1 us
        for fast, s, a, b in zip(e["skinny"], A.kernel_ms_by_rows(e["skinny_ms"]), e["packed_ms"], e["plain_ms"]):
            edge = A.skinny_edge(min(a, b), e["layers"])
            assert s <= edge + 1e-4 if fast else s >= edge - 1e-4, e
    from tokenrouter_sdk.cli.main import main

    assert main(["info"]) == 0
    assert "packed/plain/skinny by rows" in capsys.readouterr().out


def test_a_runner_built_from_its_spec_prepares_its_steps_before_any_request(store):
    """Where a sub-server starts, the runner loads the kernels, builds its projections and their
    measured choices, and packs the few-row kernel's weights: no request waits for any of it."""
    from tokenrouter_sdk.backends.torch_runner import TorchRunnerSpec

    model = tiny_model(num_layers=3, seed=9, dtype=torch.float32)
    runner = TorchRunnerSpec(model, max_kv_tokens=256).build()
    nf = runner._native
    assert nf is not None and nf._skinny_tuned and nf.projections
    entries = {k: e for k, e in A.load_choices(A.machine_fields()).items() if k.startswith("packing")}
    assert {A.group_key(p) for p in nf.projections} <= set(entries)
    assert all("skinny_ms" in e for e in entries.values())
    off = TorchRunnerSpec(model, max_kv_tokens=256, model_impl="transformers").build()
    assert off._native is None  # the transformers forward has nothing to prepare


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 20])
def test_every_prefetch_gives_the_same_bits(ops, rows):
    w, b = torch.randn(100, 64), torch.randn(100)
    wp = ops.skinny_pack(w)
    x, r = torch.randn(rows, 64), torch.randn(rows, 100)
    outs = [ops.skinny_linear(x, wp, 100, b, r, pf) for pf in range(4)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.testing.assert_close(
        outs[0].double(), x.double() @ w.double().T + b.double() + r.double(), rtol=1e-5, atol=1e-4
    )
    for bad in (-1, 4):
        with pytest.raises(RuntimeError, match="prefetch must be a locality of 0..3"):
            ops.skinny_linear(x, wp, 100, None, None, bad)


def _kernel_projections() -> list:
    projs = _packed_projections()
    assert all(p.add_skinny(torch.ops.tokenrouter_cpu) for p in projs)
    return projs


class PrefetchCost:
    """A clock that advances by ``cost[(rows, prefetch)]`` per kernel call (the kernel still
    runs), so that `measure_prefetch` sees one locality as faster at a row count."""

    def __init__(self, monkeypatch, cost):
        self.now, self.cost, self.seen = 0.0, cost, set()
        real = P.Projection.run_skinny

        def run(proj, x, residual=None, weight=None, prefetch=None):
            self.seen.add((x.shape[0], prefetch))
            self.now += self.cost[(x.shape[0], prefetch)]
            return real(proj, x, residual, weight, prefetch)

        monkeypatch.setattr(P.Projection, "run_skinny", run)

    def __call__(self):
        return self.now


@pytest.mark.parametrize("few,many", [(0, 0), (0, 2), (2, 0), (2, 2)])
def test_the_measurement_times_every_prefetch_at_every_row_count_and_picks_the_fastest_at_each(
    ops, monkeypatch, few, many
):
    """Each measured row count gets its own fastest locality (`Prefetch`: one for steps of 1-2
    rows, one from 3), and the passes stream at least `PREFETCH_MIN_BYTES` of weights (here all
    of a tiny model's, however small its cache)."""
    projs = _kernel_projections()
    fast = dict(zip(A.PREFETCH_ROWS, (few, many)))
    cost = PrefetchCost(
        monkeypatch, {(r, h): (1.0 if h == fast[r] else 3.0) for r in A.PREFETCH_ROWS for h in A.PREFETCH_HINTS}
    )
    entry = A.measure_prefetch(projs, clock=cost, llc_bytes=1)
    assert entry["chosen"] == [few, many] and entry["hints"] == list(A.PREFETCH_HINTS)
    assert cost.seen == {(r, h) for r in A.PREFETCH_ROWS for h in A.PREFETCH_HINTS}
    assert entry["layers"] == len(projs)  # all of them: far less than the least a measurement streams
    assert all(
        v == pytest.approx(1e3 * len(projs) * (1.0 if h == fast[r] else 3.0))
        for h, ms in zip(entry["hints"], entry["ms"])
        for r, v in zip(entry["rows"], ms)
    )


@pytest.mark.parametrize(
    "faster,chosen", [(0.97, [0, 2]), (0.94, [0, 0]), (1.02, [0, 2]), (1.04, [0, 2]), (1.07, [2, 2]), (1.2, [2, 2])]
)
def test_a_tie_goes_to_the_row_count_s_own_prefetch(ops, monkeypatch, faster, chosen):
    """The non-temporal prefetch takes ``faster`` times the prefetch into L2's time: within 5%
    either way it is a tie, which goes to the non-temporal one at 1 row and to the one into L2
    at 8; beyond, the faster one is chosen."""
    assert A.PREFETCH_TIE == ((0, 2), 0.05) and A.PREFETCH_HINTS == (0, 2) and A.PREFETCH_ROWS == (1, 8)
    projs = _kernel_projections()
    cost = PrefetchCost(
        monkeypatch, {(r, h): (faster if h == 0 else 1.0) for r in A.PREFETCH_ROWS for h in A.PREFETCH_HINTS}
    )
    assert A.measure_prefetch(projs, clock=cost)["chosen"] == chosen


@pytest.mark.parametrize("few,many", [(0, 2), (2, 0), (1, 3)])
def test_a_projection_runs_the_prefetch_of_its_step_s_row_count(ops, monkeypatch, few, many):
    p = _kernel_projections()[0]
    p.prefetch = A.Prefetch(few, many)
    real = torch.ops.tokenrouter_cpu.skinny_linear
    seen = []
    monkeypatch.setattr(
        torch.ops.tokenrouter_cpu, "skinny_linear", lambda *a: seen.append((a[0].shape[0], a[-1])) or real(*a)
    )
    for rows in (1, 2, 3, 8, 16):
        p.run_skinny(torch.randn(rows, p.mods[0].in_features))  # what each path on the kernel calls
    assert seen == [(1, few), (2, few), (3, many), (8, many), (16, many)]
    assert [A.Prefetch(few, many).at(r) for r in (1, A.PREFETCH_MANY_FROM - 1, A.PREFETCH_MANY_FROM)] == [
        few,
        few,
        many,
    ]


class FakePrefetch:
    def __init__(self, few, many=None):
        self.chosen, self.calls = [few, few if many is None else many], 0

    def __call__(self, projs):
        self.calls += 1
        return {
            "hints": list(A.PREFETCH_HINTS),
            "rows": list(A.PREFETCH_ROWS),
            "chosen": self.chosen,
            "ms": [[1.0] * len(A.PREFETCH_ROWS) for _ in A.PREFETCH_HINTS],
            "layers": len(projs),
        }


def test_the_prefetch_is_measured_once_stored_read_back_and_runs_in_every_path(store, ops, capsys):
    projs = _kernel_projections()
    fields = A.machine_fields()
    first = FakePrefetch(0, 2)
    A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=fields, prefetch=first)
    assert first.calls == 1 and all(p.prefetch == A.Prefetch(0, 2) for p in projs)
    again = FakePrefetch(2)
    for p in projs:
        p.prefetch = A.Prefetch()
    A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=fields, prefetch=again)
    assert again.calls == 0 and all(p.prefetch == A.Prefetch(0, 2) for p in projs)  # read back
    from tokenrouter_sdk.cli.main import main

    assert main(["info"]) == 0
    assert (
        f"{A.prefetch_key(projs)}: the few-row kernel prefetches non-temporal at 1-2 rows, into L2 from 3"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("damage", ["chosen", "one for every row count", "hints", "ms", "type", "foreign"])
def test_a_broken_or_foreign_prefetch_entry_is_measured_again(store, ops, damage):
    projs = _kernel_projections()
    fields = A.machine_fields()
    A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=fields, prefetch=FakePrefetch(2))
    path = A.choices_path(fields)
    data = json.loads(path.read_text())
    key = A.prefetch_key(projs)
    e = data["choices"][key]
    if damage == "chosen":
        e["chosen"] = [2, 5]
    elif damage == "one for every row count":
        e["chosen"] = 2  # one locality for every step size: what an older build stored
    elif damage == "hints":
        e["hints"] = [0, 1]  # measured over other candidates than these
    elif damage == "ms":
        e["ms"] = [[1.0]]
    elif damage == "type":
        data["choices"][key] = "into L2"
    path.write_text(json.dumps(data))
    other = dict(fields, cpu="another CPU") if damage == "foreign" else fields
    again = FakePrefetch(0)
    A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=other, prefetch=again)
    assert again.calls == 1 and all(p.prefetch == A.Prefetch(0, 0) for p in projs)
    assert A.load_choices(other)[key]["chosen"] == [0, 0]


def test_a_forced_prefetch_is_honoured_and_an_unknown_one_refused(store, ops, monkeypatch):
    projs = _kernel_projections()
    monkeypatch.setenv(A.PREFETCH_ENV, "3")
    never = FakePrefetch(0)
    A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=A.machine_fields(), prefetch=never)
    assert never.calls == 0 and all(p.prefetch == A.Prefetch(3, 3) for p in projs)
    assert not any(k.startswith(A.PREFETCH_KEY) for k in A.load_choices(A.machine_fields()))
    monkeypatch.setenv(A.PREFETCH_ENV, "nta")
    with pytest.raises(ValueError, match="TOKENROUTER_SKINNY_PREFETCH='nta': accepted values are auto, 0"):
        A.tune_packing(projs, measure=FakeMeasure(upto=8), fields=A.machine_fields(), prefetch=never)


def test_a_runner_measures_the_prefetch_for_real_and_its_steps_keep_their_bits(store, monkeypatch):
    """Whichever locality the runner's measurement picks, its steps give the bits of a runner
    forced to each of the others."""
    monkeypatch.setenv(A.PACKING_ENV, "skinny")  # every projection through the kernel
    ids = list(range(5, 13))
    runner = _runner(kernels="wait")
    out = _step(runner, ids)
    e = A.load_choices(A.machine_fields())[A.prefetch_key(runner._native.projections)]
    assert all(h in A.PREFETCH_HINTS for h in e["chosen"]) and all(v > 0 for ms in e["ms"] for v in ms)
    assert all(
        p.prefetch == A.Prefetch(*e["chosen"]) and p.path(len(ids)) == "skinny" for p in runner._native.projections
    )
    for h in range(4):
        monkeypatch.setenv(A.PREFETCH_ENV, str(h))
        other = _runner(kernels="wait", seed=5)
        got = _step(other, ids)
        assert all(p.prefetch == A.Prefetch(h, h) for p in other._native.projections)
        assert torch.equal(got.logits, out.logits)


class PathCost:
    """A clock advanced per projection call by its path's cost (the call still runs)."""

    def __init__(self, monkeypatch, cost):
        self.now, self.cost = 0.0, cost
        for name in ("run_packed", "run_plain", "run_skinny"):
            real = getattr(P.Projection, name)

            def run(proj, *a, _real=real, _name=name, **kw):
                self.now += self.cost[_name]
                return _real(proj, *a, **kw)

            monkeypatch.setattr(P.Projection, name, run)

    def __call__(self):
        return self.now


@pytest.mark.parametrize("skinny_cost,chosen", [(1.03, True), (1.0, True), (0.9, True), (1.08, False)])
def test_the_kernel_is_chosen_within_its_margin_of_the_fastest_path(ops, monkeypatch, skinny_cost, chosen):
    """Within 5% of the fastest other path the kernel is taken (a layer whose projections all
    take it runs as one call); beyond it, not."""
    projs = _kernel_projections()
    group = [p for p in projs if A.group_key(p) == A.group_key(projs[0])]
    clock = PathCost(monkeypatch, {"run_packed": 1.0, "run_plain": 1.2, "run_skinny": skinny_cost})
    entry = A.measure_group(group, clock=clock, llc_bytes=1 << 40)
    assert entry["skinny"] == [chosen] * len(A.BUCKETS) and entry["packed"] == [True] * len(A.BUCKETS)
    assert entry["skinny_ms"][0] == pytest.approx(1e3 * skinny_cost * len(group))


class RowsCost(PathCost):
    """`PathCost` with the few-row kernel's cost by the call's row count."""

    def __init__(self, monkeypatch, cost, skinny_by_rows):
        super().__init__(monkeypatch, cost)
        real = P.Projection.run_skinny

        def run(proj, x, *a, **kw):
            self.now += skinny_by_rows[x.shape[0]]
            return real(proj, x, *a, **kw)

        monkeypatch.setattr(P.Projection, "run_skinny", run)


@pytest.mark.parametrize(
    "slow_at,larger,chosen",
    [
        (1.5, 0.9, True),  # 2 rows met noise, 4 rows and more were fast: the kernel runs at 2
        (1.5, 1.3, False),  # slow at 2 and at every larger count: not noise
        (1.0, 1.3, True),  # fast at 2, slower above: 2 keeps its own time
    ],
)
def test_a_bucket_measured_slower_than_a_larger_one_takes_the_larger_s_time(ops, monkeypatch, slow_at, larger, chosen):
    """The kernel at fewer rows streams the same weights with fewer FMAs: a bucket timed slower
    than a larger bucket met the machine's noise, and its choice is made on the larger's time
    (measured on an Intel Xeon: 1.96 ms at 2 rows, 1.24 at 4, MKL 1.56 at 2, put the layer on
    the Python loop at 2 rows)."""
    projs = _kernel_projections()
    group = [p for p in projs if A.group_key(p) == A.group_key(projs[0])]
    by_rows = {b: (0.95 if b == 1 else slow_at if b == 2 else larger) for b in A.BUCKETS}
    clock = RowsCost(monkeypatch, {"run_packed": 1.0, "run_plain": 1.2, "run_skinny": 0.0}, by_rows)
    entry = A.measure_group(group, clock=clock, llc_bytes=1 << 40)
    env = A.kernel_ms_by_rows(entry["skinny_ms"])
    assert entry["skinny_ms"][1] == pytest.approx(1e3 * slow_at * len(group))  # stored as measured
    assert entry["skinny"][0] is True and entry["skinny"][1] is chosen
    assert entry["skinny"][2:] == [larger <= 1.05] * (len(A.BUCKETS) - 2)
    assert env[1] == pytest.approx(1e3 * min(slow_at, larger) * len(group))


def test_the_kernel_s_time_by_rows_is_the_least_at_that_bucket_or_a_larger_one():
    assert A.kernel_ms_by_rows([1.55, 1.96, 1.24, 1.68, 2.02]) == [1.24, 1.24, 1.24, 1.68, 2.02]
    assert A.kernel_ms_by_rows([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert A.kernel_ms_by_rows([]) == []


def test_models_of_another_size_keep_their_own_prefetch_choice(store, ops):
    """A model small enough to stay in the caches measures a tie: its choice must not decide for
    a model that streams from memory, so each count and size of projections has its own entry."""
    small = _kernel_projections()
    fields = A.machine_fields()
    A.tune_packing(small, measure=FakeMeasure(upto=8), fields=fields, prefetch=FakePrefetch(0))
    model = tiny_model(num_layers=5, seed=7, dtype=torch.float32)
    runner = TorchRunner(model, max_kv_tokens=256, kernels="off")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(A.PACKING_ENV, "packed")
        _step(runner, [5, 6, 7])
    bigger = runner._native.projections
    assert all(p.add_skinny(torch.ops.tokenrouter_cpu) for p in bigger)
    assert A.prefetch_key(bigger) != A.prefetch_key(small)
    other = FakePrefetch(2)
    A.tune_packing(bigger, measure=FakeMeasure(upto=8), fields=fields, prefetch=other)
    assert other.calls == 1 and all(p.prefetch == A.Prefetch(2, 2) for p in bigger)
    assert all(p.prefetch == A.Prefetch(0, 0) for p in small)
    stored = A.load_choices(fields)
    assert stored[A.prefetch_key(small)]["chosen"] == [0, 0] and stored[A.prefetch_key(bigger)]["chosen"] == [2, 2]
