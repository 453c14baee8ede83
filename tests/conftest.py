"""Fixtures shared by every tier (tiny models, a thread-leak check) and the tier order of the run
(`tests.tiers`: unit tests first, their one-line result printed before the slow tiers start).
Shared helpers that are not fixtures live in tests/helpers.py."""

import threading
from pathlib import Path

import pytest

from tests.tiers import TierReport
from tokenrouter_sdk.models import tiny_model, tiny_tokenizer, truncate


def pytest_configure(config):
    config.pluginmanager.register(TierReport(config, Path(__file__).parent), "tokenrouter-tiers")


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def pair():
    """float64 tiny pair: large = 4 layers, small = its first 2 layers (zero-copy)."""
    large = tiny_model(num_layers=4, seed=1)
    return {"small": truncate(large, 2), "large": large}


@pytest.fixture(scope="session")
def trio():
    """Three float64 tiny models of different depth and weights."""
    return {
        "s": tiny_model(num_layers=1, seed=11),
        "m": tiny_model(num_layers=2, seed=12),
        "l": tiny_model(num_layers=3, seed=13),
    }


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernel_built():
    """Build (or load from the disk cache) the CPU paged attention kernel before any test, so that
    every CPU step of the run attends the same way and its build thread is not mistaken for a
    thread a test leaked."""
    from tokenrouter_sdk.backends import cpu_kernels

    cpu_kernels.paged_attention_op(wait=True, timeout=600)


@pytest.fixture(scope="session", autouse=True)
def _choices_of_the_session(tmp_path_factory):
    """The run's measured choices (tiny models, one or two threads) go to a folder of its own,
    not to the user's, which `tokenrouter info` lists; child processes inherit it."""
    import os

    from tokenrouter_sdk.backends import autotune

    before = os.environ.get(autotune.CHOICES_ENV)
    os.environ[autotune.CHOICES_ENV] = str(tmp_path_factory.mktemp("choices"))
    yield
    if before is None:
        os.environ.pop(autotune.CHOICES_ENV, None)
    else:
        os.environ[autotune.CHOICES_ENV] = before


@pytest.fixture(autouse=True)
def _no_thread_leak():
    """A test leaves no thread of ours running that it started. A thread whose owner is garbage
    stops when the owner is collected, so a full collection runs before the verdict, only when
    such a thread is seen (one costs 0.1-0.7 s once the suite has loaded its modules and models)."""
    before = {t for t in threading.enumerate() if t.name.startswith("tokenrouter")}
    yield

    def started():
        return {t for t in threading.enumerate() if t.name.startswith("tokenrouter") and t.is_alive()} - before

    if started():
        import gc

        gc.collect()
    left = started()
    assert not left, f"threads leaked: {sorted(t.name for t in left)}"
