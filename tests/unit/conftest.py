import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny float64 forwards are ~10x faster on one thread on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
