import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """Tiny float64 forwards are ~10x faster on one thread on a shared 2-core machine (the unit
    tier only: the thread count is restored before the other tiers run)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="package", autouse=True)
def _threads_for_tiny_models():
    """Unit tests inspect sub-server state (KV pools, scheduler) in this process: run sub-servers
    in threads. tests/unit/test_processes.py covers the process transport explicitly;
    integration and notebook tests keep the real default (processes for 2+ models)."""
    import os

    old = os.environ.get("TOKENROUTER_PROCESSES")
    os.environ["TOKENROUTER_PROCESSES"] = "0"
    yield
    if old is None:
        os.environ.pop("TOKENROUTER_PROCESSES", None)
    else:
        os.environ["TOKENROUTER_PROCESSES"] = old
