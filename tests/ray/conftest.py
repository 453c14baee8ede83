"""The Ray tier: skipped when Ray is not installed (``pip install 'tokenrouter-sdk[ray]'``).

One simulated two-node cluster (`ray.cluster_utils.Cluster`) serves the whole tier, on the
loopback address only (Ray's loopback mode), with token authentication off and its files under
a temporary folder, removed at the end; the Ray processes end with it."""

import os
import shutil
import tempfile

import pytest

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
_OLD_ENV = {k: os.environ.get(k) for k in LOOPBACK_ENV}
os.environ.update(LOOPBACK_ENV)  # before Ray is imported: it reads them then (else it binds the host's interface)
ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def cluster():
    """A head node (resource ``node_a``) and a second node (``node_b``), 2 CPUs each; the test
    process is connected as the driver."""
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="tokenrouter-ray-")
    env = dict(LOOPBACK_ENV, RAY_TMPDIR=tmp)
    old = dict(_OLD_ENV, RAY_TMPDIR=os.environ.get("RAY_TMPDIR"))
    os.environ.update(env)
    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False}
    )
    c.add_node(num_cpus=2, resources={"node_b": 1})
    assert c.address.startswith("127.0.0.1:"), c.address  # loopback only
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
