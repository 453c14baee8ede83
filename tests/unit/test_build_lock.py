"""Models built in threads of one process are built one at a time: loading a model changes
torch's process-wide default dtype for the duration of the load, so two sub-server threads
loading at once left the process with a float64 default dtype (every later ``torch.zeros``
float64) after a Router on float64 folders."""

import threading
import time

import torch

from tests.helpers import save_tiny_pair
from tokenrouter_sdk import Router
from tokenrouter_sdk.engine.runner import RunnerInfo, build_runner
from tokenrouter_sdk.policies import RandomRouting


class SlowSpec:
    """A `RunnerSpec` whose build takes 0.2 s and records when it ran."""

    def __init__(self, spans: list):
        self.spans = spans

    def describe(self) -> RunnerInfo:  # pragma: no cover - never asked here
        raise NotImplementedError

    def build(self):
        start = time.monotonic()
        time.sleep(0.2)
        self.spans.append((start, time.monotonic()))
        return object()


def test_runner_builds_in_threads_never_overlap():
    spans: list = []
    threads = [threading.Thread(target=build_runner, args=(SlowSpec(spans),)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 3
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans


def test_a_router_on_float64_folders_in_threads_leaves_the_default_dtype(tmp_path):
    folders = save_tiny_pair(tmp_path)
    for _ in range(4):
        with Router(
            {"small": folders[0], "large": folders[1]}, RandomRouting(p=0.5, seed=1), dtype="float64", processes=False
        ) as r:
            assert {run.dtype for run in r.engine.runners.values()} == {torch.float64}
            assert r.generate(["a b"], max_new_tokens=3, ignore_eos=True)[0].ok
        assert torch.get_default_dtype() == torch.float32
        assert torch.zeros(1).dtype == torch.float32
