"""The longest extend the CPU kernel attends is measured on this machine per model shape, stored
beside the GEMM choices, forced by ``TOKENROUTER_KERNEL_EXTEND``, and a broken or foreign entry is
measured again; whichever limit holds, a runner's steps give the same logits."""

import json

import pytest
import torch

from tokenrouter_sdk.backends import autotune as A
from tokenrouter_sdk.backends import cpu_kernels
from tokenrouter_sdk.backends.attention import kernel_choice as K
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model


@pytest.fixture(scope="module")
def op():
    op = cpu_kernels.paged_attention_op(wait=True)
    if op is None:
        pytest.skip(f"the CPU kernels could not be built: {cpu_kernels.error()}")
    return op


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty choices folder and no forced limit."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(A.CHOICES_ENV, raising=False)  # the store is this extension root's
    monkeypatch.delenv(K.ENV, raising=False)
    monkeypatch.delenv(K.TILES_ENV, raising=False)
    return tmp_path


class FakeMeasure:
    """The kernel wins up to ``upto`` queries; counts its calls."""

    def __init__(self, upto=4):
        self.upto, self.calls = upto, 0

    def __call__(self, op, heads, kv_heads, dim, dtype, layers):
        self.calls += 1
        wins = [b <= self.upto for b in K.BUCKETS]
        return {
            "buckets": list(K.BUCKETS),
            "kernel": wins,
            "kernel_ms": [1.0] * len(wins),
            "gather_ms": [2.0] * len(wins),
            "limit": K.limit_of(K.BUCKETS, wins),
            "context": 512,
            "decodes": 3,
            "layers": layers,
        }


def test_the_limit_is_the_last_bucket_of_the_first_winning_run():
    assert K.limit_of((2, 4, 8, 16), (True, True, False, True)) == 4
    assert K.limit_of((2, 4, 8, 16), (False, True, True, True)) == 1
    assert K.limit_of((2, 4, 8, 16), (True, True, True, True)) == 16


def test_measured_once_then_read_from_the_store(store):
    fake = FakeMeasure(upto=8)
    assert K.extend_limit(None, 9, 3, 64, torch.float32, 30, measure_fn=fake) == (8, "measured")
    assert K.extend_limit(None, 9, 3, 64, torch.float32, 30, measure_fn=fake) == (8, "cached")
    assert fake.calls == 1
    # another shape is another choice
    assert K.extend_limit(None, 4, 2, 16, torch.float32, 2, measure_fn=FakeMeasure(upto=2)) == (2, "measured")


@pytest.mark.parametrize("damage", ["not json", "wrong limit", "foreign fields"])
def test_a_broken_or_foreign_entry_is_measured_again(store, damage):
    fields = A.machine_fields()
    K.extend_limit(None, 9, 3, 64, torch.float32, 30, measure_fn=FakeMeasure(upto=4), fields=fields)
    path = A.choices_path(fields)
    data = json.loads(path.read_text())
    key = K.choice_key(9, 3, 64, torch.float32, 30)
    if damage == "not json":
        path.write_text("{oops")
    elif damage == "wrong limit":  # a limit its own timings do not give
        data["choices"][key]["limit"] = 32
        path.write_text(json.dumps(data))
    else:
        data["fields"] = dict(fields, cpu="another CPU")
        path.write_text(json.dumps(data))
    fake = FakeMeasure(upto=16)
    assert K.extend_limit(None, 9, 3, 64, torch.float32, 30, measure_fn=fake, fields=fields) == (16, "measured")
    assert fake.calls == 1
    assert json.loads(path.read_text())["choices"][key]["limit"] == 16


def test_a_forced_limit_is_honoured_and_a_bad_one_refused(store, monkeypatch):
    fake = FakeMeasure()
    monkeypatch.setenv(K.ENV, "6")
    assert K.extend_limit(None, 9, 3, 64, torch.float32, 30, measure_fn=fake) == (6, f"forced ({K.ENV}=6)")
    assert fake.calls == 0
    for bad in ("0", "many", "-3"):
        monkeypatch.setenv(K.ENV, bad)
        with pytest.raises(ValueError, match=K.ENV):
            K.extend_limit(None, 9, 3, 64, torch.float32, 30, measure_fn=fake)


def test_a_real_measurement_times_both_paths(store, op):
    entry = K.measure(op, 4, 2, 16, torch.float64, 2, buckets=(2, 4), reps=2)
    assert entry["buckets"] == [2, 4] and len(entry["kernel_ms"]) == len(entry["gather_ms"]) == 2
    assert all(t > 0 for t in entry["kernel_ms"] + entry["gather_ms"])
    assert entry["kernel"] == [a < b for a, b in zip(entry["kernel_ms"], entry["gather_ms"])]
    assert entry["limit"] == K.limit_of([2, 4], entry["kernel"])


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 1e-4)])
def test_steps_give_the_same_logits_whichever_limit(store, op, monkeypatch, dtype, tol):
    """Prefill, then a batch of decodes and extends of 2, 5 and 12 tokens, with the limit forced
    to 1 (every extend gathers), 5 and 16 (all in the kernel), and the tiles forced to never, from
    2 and from 12 queries: same logits and hidden states (the kernel's with tiles or not: the same
    bits), and the runner reports the limit and tiles it used and the kernel attended exactly the
    extends within the limit."""
    from tokenrouter_sdk.backends.attention import cpu_kernel

    seen: list[int] = []
    real = cpu_kernel.CpuKernel.attend
    monkeypatch.setattr(
        cpu_kernel.CpuKernel, "attend", lambda self, kern, *a: seen.extend(kern.q_len.tolist()) or real(self, kern, *a)
    )
    model = tiny_model(num_layers=3, seed=8, dtype=dtype)
    outs = {}
    for limit, tiles in [(1, 0), (5, 0), (16, 0), (5, 2), (16, 2), (16, 12)]:
        seen.clear()
        monkeypatch.setenv(K.ENV, str(limit))
        monkeypatch.setenv(K.TILES_ENV, str(tiles))
        r = TorchRunner(model, max_kv_tokens=1024, kernels="wait")
        tables = [[] for _ in range(4)]
        feeds = [[list(range(3, 3 + 40 + 7 * i)) for i in range(4)], [[5], [6, 7], [8] * 5, [9] * 12]]
        starts = [0] * 4
        for feed in feeds:
            for t, s, f in zip(tables, starts, feed):
                blocks_of(r).ensure(t, s + len(f))
            out = r.forward([SeqInput(f, s, t) for f, s, t in zip(feed, starts, tables)])
            starts = [s + len(f) for s, f in zip(starts, feed)]
        outs[limit, tiles] = out
        assert r.kernel_extend == (limit, f"forced ({K.ENV}={limit})")
        assert r.kernel_tiles == (tiles, f"forced ({K.TILES_ENV}={tiles})")
        assert set(seen) == {n for n in (1, 2, 5, 12) if n <= limit}, (limit, sorted(set(seen)))
    for key, out in outs.items():
        torch.testing.assert_close(out.logits, outs[1, 0].logits, rtol=tol, atol=tol)
        torch.testing.assert_close(out.hidden, outs[1, 0].hidden, rtol=tol, atol=tol)
        if key[0] == 16:
            assert torch.equal(out.logits, outs[16, 0].logits), key  # tiles or not: the same bits


def test_a_runner_measures_its_limit_at_its_first_kernel_step(store, op):
    model = tiny_model(num_layers=2, seed=4, dtype=torch.float64)
    r = TorchRunner(model, max_kv_tokens=256, kernels="wait")
    t: list[int] = []
    blocks_of(r).ensure(t, 8)
    r.forward([SeqInput([5, 6, 7], 0, t)])
    limit, source = r.kernel_extend
    assert source == "measured" and limit in (1, *K.BUCKETS)
    stored = A.load_choices(A.machine_fields())
    assert r.kernel_tiles == (0, "no tiles for float64")  # float64 pools have no tiles: nothing measured
    key = K.choice_key(model.config.num_attention_heads, r.pool.k.shape[-2], r.pool.k.shape[-1], torch.float64, 2)
    assert stored[key + " tiles=0"]["limit"] == limit


def test_info_prints_the_extend_choice(store, capsys):
    from tokenrouter_sdk.cli.main import main

    K.extend_limit(None, 9, 3, 64, torch.float32, 30, measure_fn=FakeMeasure(upto=4))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "extend kernel float32 heads=9 kv=3 dim=64 layers=30: the kernel attends extends of up to 4 queries" in out


class FakeTiles:
    """Tiles win from ``start`` queries (0: never); counts its calls."""

    def __init__(self, start=4):
        self.start, self.calls = start, 0

    def __call__(self, op, heads, kv_heads, dim, dtype, layers):
        self.calls += 1
        wins = [bool(self.start) and b >= self.start for b in K.TILE_BUCKETS]
        return {
            "buckets": list(K.TILE_BUCKETS),
            "tiles": wins,
            "tiles_ms": [1.0] * len(wins),
            "keys_ms": [2.0] * len(wins),
            "tile_from": K.tile_from_of(K.TILE_BUCKETS, wins),
            "context": 512,
            "decodes": 3,
            "layers": layers,
        }


def test_tiles_start_where_they_win_at_every_larger_bucket():
    assert K.tile_from_of((2, 3, 4, 8), (False, False, True, True)) == 4
    assert K.tile_from_of((2, 3, 4, 8), (True, False, True, True)) == 4
    assert K.tile_from_of((2, 3, 4, 8), (True, True, True, True)) == 2
    assert K.tile_from_of((2, 3, 4, 8), (True, True, True, False)) == 0


def test_the_tile_choice_is_measured_once_forced_or_refused(store, monkeypatch):
    fake = FakeTiles(start=6)
    assert K.tile_choice(None, 9, 3, 64, torch.float32, 30, measure_fn=fake) == (6, "measured")
    assert K.tile_choice(None, 9, 3, 64, torch.float32, 30, measure_fn=fake) == (6, "cached")
    assert K.tile_choice(None, 9, 3, 64, torch.float64, 30, measure_fn=fake) == (0, "no tiles for float64")
    assert K.tile_choice(None, 9, 3, 64, torch.float16, 30, measure_fn=fake) == (0, "no tiles for float16")
    assert K.tile_choice(None, 9, 3, 64, torch.bfloat16, 30, measure_fn=fake) == (6, "measured")  # its own entry
    with monkeypatch.context() as mp:  # a CPU without AVX-512: the kernel has no tiles there
        mp.setattr(A, "cpu_flags", lambda: {"avx2", "fma"})
        assert K.tile_choice(None, 4, 2, 16, torch.float32, 2, measure_fn=fake) == (0, "no tiles without AVX-512")
    assert fake.calls == 2
    monkeypatch.setenv(K.TILES_ENV, "0")
    assert K.tile_choice(None, 9, 3, 64, torch.float32, 30, measure_fn=fake) == (0, f"forced ({K.TILES_ENV}=0)")
    for bad in ("-1", "some"):
        monkeypatch.setenv(K.TILES_ENV, bad)
        with pytest.raises(ValueError, match=K.TILES_ENV):
            K.tile_choice(None, 9, 3, 64, torch.float32, 30, measure_fn=fake)
    assert fake.calls == 2


def test_a_tile_entry_its_timings_do_not_give_is_measured_again(store):
    fields = A.machine_fields()
    K.tile_choice(None, 9, 3, 64, torch.float32, 30, measure_fn=FakeTiles(start=4), fields=fields)
    path = A.choices_path(fields)
    data = json.loads(path.read_text())
    key = K.tiles_key(9, 3, 64, torch.float32, 30)
    data["choices"][key]["tile_from"] = 2
    path.write_text(json.dumps(data))
    fake = FakeTiles(start=8)
    assert K.tile_choice(None, 9, 3, 64, torch.float32, 30, measure_fn=fake, fields=fields) == (8, "measured")
    assert fake.calls == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_tile_measurement_times_both_score_paths(store, op, dtype):
    entry = K.measure_tiles(op, 4, 2, 16, dtype, 2, buckets=(2, 8), reps=2)
    assert entry["buckets"] == [2, 8] and all(t > 0 for t in entry["tiles_ms"] + entry["keys_ms"])
    assert entry["tiles"] == [a < b for a, b in zip(entry["tiles_ms"], entry["keys_ms"])]
    assert entry["tile_from"] == K.tile_from_of([2, 8], entry["tiles"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float32_or_bfloat16_runner_measures_its_tiles_then_its_limit_with_them(store, op, dtype):
    model = tiny_model(num_layers=2, seed=4, dtype=dtype)
    r = TorchRunner(model, max_kv_tokens=256, kernels="wait")
    t: list[int] = []
    blocks_of(r).ensure(t, 8)
    r.forward([SeqInput([5, 6, 7], 0, t)])
    tiles, source = r.kernel_tiles
    stored = A.load_choices(A.machine_fields())
    shape = (model.config.num_attention_heads, r.pool.k.shape[-2], r.pool.k.shape[-1], dtype, 2)
    if "avx512f" in A.cpu_flags():
        assert source == "measured" and tiles in (0, *K.TILE_BUCKETS)
        assert stored[K.tiles_key(*shape)]["tile_from"] == tiles
    else:
        assert (tiles, source) == (0, "no tiles without AVX-512") and K.tiles_key(*shape) not in stored
    assert stored[K.choice_key(*shape) + f" tiles={tiles}"]["limit"] == r.kernel_extend[0]


def test_info_prints_the_tile_choice(store, capsys):
    from tokenrouter_sdk.cli.main import main

    K.tile_choice(None, 9, 3, 64, torch.float32, 30, measure_fn=FakeTiles(start=4))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert (
        "tiles kernel float32 heads=9 kv=3 dim=64 layers=30: the kernel scores 16 keys at a time from 4 queries" in out
    )
