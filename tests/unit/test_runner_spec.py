"""A runner the Router builds is made from a `TorchRunnerSpec` in the process that serves its model
(the child of the process transport, the sub-server thread of the thread transport): no runner
object is pickled on the way, what the engine knows before start (`describe`) is what the built
runner has, and a routed run through processes equals the naive reference."""

import threading

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.backends.torch_runner import TorchRunner, TorchRunnerSpec
from tokenrouter_sdk.engine.front.engine import Engine
from tokenrouter_sdk.engine.runner import PoolShape, RemoteRunner, RunnerInfo, RunnerSpec
from tokenrouter_sdk.engine.transports import wire
from tokenrouter_sdk.engine.transports.process_transport import ProcessTransport
from tokenrouter_sdk.engine.transports.transport import ThreadTransport
from tokenrouter_sdk.models import tiny_model, truncate
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import ScriptedRunner, mixed_prompts


@pytest.fixture(scope="module")
def small_pair():
    """A float64 tiny pair built in code: large = 3 layers, small = its first layer (zero-copy)."""
    large = tiny_model(num_layers=3, seed=21)
    return {"small": truncate(large, 1), "large": large}


def _no_pickling(self):
    raise AssertionError("a TorchRunner was pickled: the Router's runners must be built where they run")


def test_process_children_get_runner_specs_not_runners(small_pair, tok, monkeypatch):
    shipped = []
    dump = wire.dump_spec

    def recording_dump(spec):
        shipped.append(spec)
        return dump(spec)

    monkeypatch.setattr(TorchRunner, "__getstate__", _no_pickling)
    monkeypatch.setattr("tokenrouter_sdk.engine.transports.process_transport.dump_spec", recording_dump)
    with Router(small_pair, RandomRouting(p=0.5, seed=2), tokenizer=tok, processes=True, max_kv_tokens=256) as r:
        assert isinstance(r.engine.transport, ProcessTransport)
        assert sorted(s["name"] for s in shipped) == ["large", "small"]
        assert all(isinstance(s["runner"], TorchRunnerSpec) for s in shipped)
        for name, view in r.engine.runners.items():  # this process's view of each child's runner
            assert isinstance(view, RemoteRunner) and not isinstance(view, RunnerSpec)
            assert (view.pool.capacity_tokens, view.dtype, view.device.type) == (256, torch.float64, "cpu")
            assert view.vocab_size == small_pair[name].get_output_embeddings().weight.shape[0]
            assert view.impl == "native" and view.kernels == "auto"
            assert any(s["runner"] is view.runner_spec for s in shipped)
            assert len(view.spec.layers) == small_pair[name].config.num_hidden_layers  # the AttentionSpec
            assert getattr(view, "graphs", None) is None and getattr(view, "latency", None) is None
        out = r.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True, timeout=120)[0]
        assert out.error is None and len(out.token_ids) == 4
        # each child reported the runner it built, and it is what the engine planned with
        assert r.engine.transport.reported() == {m: r.engine.info[m].geometry() for m in small_pair}
        assert r.engine.info["large"].geometry()["num_blocks"] == 256 // 16


def test_routed_run_through_processes_equals_the_reference(small_pair, tok):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    policy = RandomRouting(p=0.4, seed=5)
    with Router(small_pair, policy, tokenizer=tok, processes=True, max_kv_tokens=1024) as r:
        outs = r.generate(mixed_prompts(6, seed=3), sampling=params, concurrency=4, timeout=120)
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(small_pair, o.prompt, policy, params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), f"rid {o.rid}"
        assert (o.hops, o.discarded) == (ref["hops"], ref["discarded"])
    assert {m for o in outs for m in o.token_models} == {"small", "large"}


def test_thread_transport_builds_each_runner_in_its_subserver_thread(small_pair, tok, monkeypatch):
    where = {}
    init = TorchRunner.__init__

    def recording_init(self, model, **kw):
        where[id(model)] = threading.current_thread().name
        init(self, model, **kw)

    monkeypatch.setattr(TorchRunner, "__init__", recording_init)
    with Router(small_pair, tokenizer=tok, processes=False, max_kv_tokens=256) as r:
        assert all(isinstance(x, TorchRunner) for x in r.engine.runners.values())
        assert {n: where[id(m)] for n, m in small_pair.items()} == {n: f"tokenrouter-{n}" for n in small_pair}
        assert r.engine.transport.subservers["large"].runner is r.engine.runners["large"]


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"cuda_graphs": True, "block_size": 4},
        {"compile": True, "block_size": 2},
        {"model_impl": "transformers", "kernels": "off"},
    ],
)
def test_describe_says_what_build_makes(small_pair, opts):
    spec = TorchRunnerSpec(small_pair["large"], max_kv_tokens=100, **opts)
    info = spec.describe()
    runner = spec.build()
    try:
        assert (info.vocab_size, info.max_context, info.device, info.dtype) == (
            runner.vocab_size,
            runner.max_context,
            runner.device,
            runner.dtype,
        )
        assert (info.pool.num_blocks, info.pool.block_size, info.pool.scratch_blocks, info.pool.capacity_tokens) == (
            runner.pool.num_blocks,
            runner.pool.block_size,
            runner.pool.scratch_blocks,
            runner.pool.capacity_tokens,
        )
        assert {k: getattr(runner, k) for k in info.extra} == info.extra
        assert runner.spec is spec.attention  # read once, where the spec was described
    finally:
        runner.release()


def test_a_folder_spec_loads_where_it_is_built(tmp_path, tok):
    model = tiny_model(num_layers=2, seed=4, dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    spec = TorchRunnerSpec(tmp_path / "m", max_kv_tokens=64)
    info = spec.describe()
    runner = spec.build()
    try:
        assert (info.vocab_size, info.max_context, info.device, info.dtype, info.pool.capacity_tokens) == (
            runner.vocab_size,
            runner.max_context,
            runner.device,
            runner.dtype,
            runner.pool.capacity_tokens,
        )
        assert runner.dtype == torch.float32 and runner.model is not model
    finally:
        runner.release()


def test_bad_settings_and_placement_raise_when_the_spec_is_made(small_pair):
    m = small_pair["large"]
    with pytest.raises(ValueError, match="kernels"):
        TorchRunnerSpec(m, kernels="flash")
    with pytest.raises(ValueError, match="model_impl"):
        TorchRunnerSpec(m, model_impl="vllm")
    with pytest.raises(ValueError, match="compile"):
        TorchRunnerSpec(m, compile="sometimes")
    with pytest.raises(ValueError, match="float64"):
        TorchRunnerSpec(m, dtype="float32")
    with pytest.raises(ValueError, match="cpu"):
        TorchRunnerSpec(m, device="meta")
    assert TorchRunnerSpec(m, dtype="auto", device="cpu").dtype == torch.float64


class _ScriptedSpec:
    """A `RunnerSpec` of a `ScriptedRunner` whose build can fail (as a KV pool allocation that
    runs out of memory would)."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def describe(self) -> RunnerInfo:
        return RunnerInfo(259, 512, torch.device("cpu"), torch.float32, PoolShape(64, 16))

    def build(self):
        if self.fail:
            raise MemoryError("no room for the KV pool")
        return ScriptedRunner(lambda pos: 7, max_kv_tokens=64 * 16)


def test_engine_builds_specs_in_threads_and_raises_a_failed_build(tok):
    e = Engine({"a": _ScriptedSpec(), "b": _ScriptedSpec()}, tok, transport=ThreadTransport())
    try:
        assert all(isinstance(r, ScriptedRunner) for r in e.runners.values())
        assert e.capacity == {"a": (64, 16), "b": (64, 16)} and e.max_context == 512
    finally:
        e.close()
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(MemoryError, match="no room"):
        Engine({"a": _ScriptedSpec(), "b": _ScriptedSpec(fail=True)}, tok, transport=ThreadTransport())
    assert {t.name for t in threading.enumerate() if t.name.startswith("tokenrouter")} <= before


def test_prefetch_starts_the_kernel_build_only_where_the_kernels_apply(small_pair, monkeypatch):
    """The Router starts the CPU kernels' build where it makes the specs, so the sub-server that
    builds the runner loads the cached library instead of compiling it while requests run."""
    from tokenrouter_sdk.backends import cpu_kernels

    started = []
    monkeypatch.setattr(cpu_kernels, "start", lambda: started.append(1))
    large = small_pair["large"]
    TorchRunnerSpec(large).prefetch()
    assert started == [1]
    TorchRunnerSpec(large, kernels="off").prefetch()
    TorchRunnerSpec(tiny_model(num_layers=1, seed=3).to(torch.float16)).prefetch()  # no kernel takes float16
    assert started == [1]
    TorchRunnerSpec(tiny_model(num_layers=1, seed=3).to(torch.bfloat16)).prefetch()
    assert started == [1, 1]


def test_the_router_prefetches_its_runner_specs(small_pair, tok, monkeypatch):
    calls = []
    monkeypatch.setattr(TorchRunnerSpec, "prefetch", lambda self: calls.append(self.model))
    with Router(small_pair, tokenizer=tok, processes=False) as r:
        assert len(r.generate([1, 2, 3], max_new_tokens=2).token_ids) == 2
    assert [id(m) for m in calls] == [id(small_pair["small"]), id(small_pair["large"])]


class _MisdescribedSpec(_ScriptedSpec):
    """Describes 64 blocks, builds a runner of 32."""

    def build(self):
        return ScriptedRunner(lambda pos: 7, max_kv_tokens=32 * 16)


def test_a_runner_built_otherwise_than_its_spec_described_fails_the_start(tok):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(
        RuntimeError,
        match=r"model 'b': its runner was built as .*'num_blocks': 32.* described "
        r".*'num_blocks': 64",
    ):
        Engine({"a": _ScriptedSpec(), "b": _MisdescribedSpec()}, tok, transport=ThreadTransport())
    assert {t.name for t in threading.enumerate() if t.name.startswith("tokenrouter")} <= before
