"""The GEMM path of each projection group is chosen by measuring on this machine, stored per
machine and versions, forced by ``TOKENROUTER_PACKING``, and a broken or foreign store entry is
measured again."""

import json
from pathlib import Path

import pytest
import torch

from tokenrouter_sdk.backends import autotune as A
from tokenrouter_sdk.backends import projection as P
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.core.block_allocator import blocks_of
from tokenrouter_sdk.engine.runner import SeqInput
from tokenrouter_sdk.models import tiny_model

pytestmark = pytest.mark.skipif(
    not P.packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN packing in this torch"
)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty extension root (the choices file lives there) and no forced choice."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(A.CHOICES_ENV, raising=False)  # the store is this extension root's
    monkeypatch.delenv(A.PACKING_ENV, raising=False)
    return tmp_path


def _projections(seed=3, layers=3, choice=None):
    """A float32 native runner after one step, and its projections; ``choice``: the
    ``TOKENROUTER_PACKING`` its first step sees (None: as set now)."""
    model = tiny_model(num_layers=layers, seed=seed, dtype=torch.float32)
    runner = TorchRunner(model, max_kv_tokens=256, kernels="off")
    table: list[int] = []
    blocks_of(runner).ensure(table, 8)
    with pytest.MonkeyPatch.context() as mp:
        if choice is not None:
            mp.setenv(A.PACKING_ENV, choice)
        runner.forward([SeqInput([5, 6, 7], 0, table)])
    return runner, runner._native.projections


class FakeMeasure:
    """Packed wins from ``from_rows`` rows on; counts the groups it measured."""

    def __init__(self, from_rows=4):
        self.from_rows, self.calls = from_rows, []

    def __call__(self, projs):
        self.calls.append(A.group_key(projs[0]))
        return {
            "buckets": list(A.BUCKETS),
            "packed": [b >= self.from_rows for b in A.BUCKETS],
            "packed_ms": [1.0] * len(A.BUCKETS),
            "plain_ms": [1.0] * len(A.BUCKETS),
            "layers": len(projs),
        }


def test_rule_takes_the_next_larger_bucket_and_the_last_past_the_end():
    rule = A.PackRule((1, 4, 16), (False, True, False))
    assert [rule(m) for m in (1, 2, 3, 4, 5, 16, 17, 1000)] == [False, True, True, True, False, False, False, False]
    assert rule.describe() == "plain at 1, packed at 4, plain at 16 rows"


def test_measured_once_per_group_then_read_from_the_store(store):
    _, projs = _projections(choice="packed")  # built without measuring
    fields = A.machine_fields()
    fake = FakeMeasure(from_rows=4)
    rules = A.tune_packing(projs, measure=fake, fields=fields)
    # four shapes per layer group (q/k/v, o, gate/up, down) and the head; every layer of a shape shares one choice
    assert len(fake.calls) == len(set(fake.calls)) == len(rules) == len({A.group_key(p) for p in projs})
    assert all(r.source == "measured" and not r(2) and r(4) and r(100) for r in rules.values())
    assert all(p.rule == rules[A.group_key(p)] for p in projs)
    again = FakeMeasure(from_rows=1)
    rules2 = A.tune_packing(projs, measure=again, fields=fields)
    assert again.calls == [] and all(r.source == "cached" and not r(2) and r(4) for r in rules2.values())
    stored = json.loads(A.choices_path(fields).read_text())
    assert stored["fields"] == fields and set(stored["choices"]) == set(rules)


def test_choices_go_to_the_folder_the_environment_names(store, monkeypatch):
    """``TOKENROUTER_CHOICES_DIR`` holds the choices files (the test session keeps its tiny
    models' there, out of the user's); unset, they live beside the kernels' build."""
    _, projs = _projections(choice="packed")
    fields = A.machine_fields()
    beside = store / "tokenrouter" / "choices"
    assert A.choices_path(fields).parent == beside
    own = store / "elsewhere"
    monkeypatch.setenv(A.CHOICES_ENV, str(own))
    rules = A.tune_packing(projs, measure=FakeMeasure(), fields=fields)
    assert A.choices_path(fields).parent == own
    assert set(json.loads(A.choices_path(fields).read_text())["choices"]) == set(rules)
    assert not beside.exists() or not list(beside.glob("*.json"))
    monkeypatch.delenv(A.CHOICES_ENV)
    assert A.load_choices(fields) == {}  # the other folder is not read


def test_the_test_session_keeps_its_choices_out_of_the_user_s():
    import os

    folder = os.environ.get(A.CHOICES_ENV)
    assert folder and A.choices_path(A.machine_fields()).parent == Path(folder)
    from tokenrouter_sdk.backends.cpu_kernels import build_directory

    assert Path(folder) != build_directory("choices")


def test_another_machine_or_version_measures_anew(store):
    _, projs = _projections(choice="packed")  # built without measuring
    fields = A.machine_fields()
    A.tune_packing(projs, measure=FakeMeasure(4), fields=fields)
    other = dict(fields, cpu="Some Other CPU", threads=fields["threads"] + 1)
    fake = FakeMeasure(1)
    rules = A.tune_packing(projs, measure=fake, fields=other)
    assert fake.calls and all(r.source == "measured" and r(1) for r in rules.values())
    # a file written for other fields at this machine's path (copied from elsewhere) is foreign
    A.choices_path(fields).write_text(A.choices_path(other).read_text())
    fake = FakeMeasure(8)
    rules = A.tune_packing(projs, measure=fake, fields=fields)
    assert fake.calls and all(r.source == "measured" and not r(4) and r(8) for r in rules.values())


@pytest.mark.parametrize("damage", ["not json {", '{"fields": 1}', "entry"])
def test_a_corrupt_store_is_measured_again_and_rewritten(store, damage):
    _, projs = _projections(choice="packed")  # built without measuring
    fields = A.machine_fields()
    A.tune_packing(projs, measure=FakeMeasure(4), fields=fields)
    path = A.choices_path(fields)
    if damage == "entry":  # one group's entry broken, the others intact
        data = json.loads(path.read_text())
        key = sorted(data["choices"])[0]
        data["choices"][key]["packed"] = [True]
        path.write_text(json.dumps(data))
    else:
        path.write_text(damage)
    fake = FakeMeasure(2)
    rules = A.tune_packing(projs, measure=fake, fields=fields)
    if damage == "entry":
        assert fake.calls == [key]
    else:
        assert sorted(fake.calls) == sorted(rules)
    assert all(rules[k].source == "measured" and rules[k](2) for k in fake.calls)
    assert set(json.loads(path.read_text())["choices"]) == set(rules)


@pytest.mark.parametrize("forced", ["packed", "plain"])
def test_a_forced_choice_is_honoured_and_gives_the_same_logits(store, monkeypatch, forced):
    monkeypatch.setenv(A.PACKING_ENV, forced)
    runner, projs = _projections(seed=5)
    assert all(p.rule.source == f"forced ({A.PACKING_ENV}={forced})" for p in projs if p.packed is not None)
    assert all(p.rule(m) == (forced == "packed") for p in projs if p.packed is not None for m in (1, 7, 500))
    calls = []
    orig = P.Projection.run_packed
    monkeypatch.setattr(P.Projection, "run_packed", lambda self, x: calls.append(1) or orig(self, x))
    table: list[int] = []
    blocks_of(runner).ensure(table, 8)
    out = runner.forward([SeqInput([9, 10, 11, 12], 0, table)])
    assert bool(calls) == (forced == "packed")
    ref = TorchRunner(runner.model, max_kv_tokens=256, model_impl="transformers")
    t2: list[int] = []
    blocks_of(ref).ensure(t2, 8)
    torch.testing.assert_close(out.logits, ref.forward([SeqInput([9, 10, 11, 12], 0, t2)]).logits, rtol=0, atol=1e-5)
    # forced: no GEMM path measured or stored (the kernel's extend limit may be)
    assert not any(k.startswith("packing") for k in A.load_choices(A.machine_fields()))


def test_the_key_names_this_machine_and_its_libraries():
    f = A.machine_fields()
    assert f["cpu"] and f["llc_bytes"] > 0 and f["torch"] == torch.__version__ and f["threads"] >= 1
    assert f["onednn"].count(".") >= 1  # torch's oneDNN build (it packs the weights) is part of the key


def test_an_unknown_forced_value_is_refused(store, monkeypatch):
    monkeypatch.setenv(A.PACKING_ENV, "fastest")
    with pytest.raises(ValueError, match="TOKENROUTER_PACKING='fastest': accepted values are auto, packed, plain"):
        _projections()


def test_a_real_measurement_times_both_paths_at_every_bucket(store):
    _, projs = _projections(layers=4)
    group = [p for p in projs if A.group_key(p) == A.group_key(projs[0])]
    entry = A.measure_group(group, buckets=(1, 8), reps=2, llc_bytes=1)
    assert entry["buckets"] == [1, 8] and entry["layers"] == 1  # two cache sizes are one layer here
    assert all(v > 0 for v in entry["packed_ms"] + entry["plain_ms"])
    # packed where it was faster (the times are rounded to 0.1 us: two that round alike may go either way)
    pairs = zip(entry["packed"], entry["packed_ms"], entry["plain_ms"])
    assert len(entry["packed"]) == 2 and all(p == (a < b) for p, a, b in pairs if a != b)
    whole = A.measure_group(group, buckets=(2,), reps=1, llc_bytes=1 << 40)
    assert whole["layers"] == len(group) == 4


def test_info_prints_the_choices_and_their_timings(store, capsys):
    from tokenrouter_sdk.cli.main import main

    _projections()  # auto: measured for real and stored
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "measured choices:" in out and "thread(s), packing float32 in=" in out and "packed/plain by rows" in out


def test_a_folder_that_cannot_be_written_measures_without_storing(store, monkeypatch):
    _, projs = _projections(choice="packed")
    (store / "a_file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(store / "a_file"))  # a folder below a file cannot be made
    fake = FakeMeasure(2)
    rules = A.tune_packing(projs, measure=fake, fields=A.machine_fields())
    assert fake.calls and all(r.source == "measured (not stored)" and r(2) and not r(1) for r in rules.values())
