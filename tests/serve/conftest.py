"""Fixtures of the HTTP server tests: the tiny float64 pair and a scripted pair, each in one
Router with sub-servers in threads, served on 127.0.0.1 at a free port."""

import contextlib
import os

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


@pytest.fixture(autouse=True, scope="package")
def _one_thread_and_threads():
    """Tiny float64 forwards are fastest on one torch thread; sub-servers in threads (the tests
    read KV pools in this process). The packaged-pair tests keep the real default (processes)
    by building their Routers with ``processes=True``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    old = os.environ.get("TOKENROUTER_PROCESSES")
    os.environ["TOKENROUTER_PROCESSES"] = "0"
    yield
    torch.set_num_threads(n)
    if old is None:
        os.environ.pop("TOKENROUTER_PROCESSES", None)
    else:
        os.environ["TOKENROUTER_PROCESSES"] = old


@contextlib.contextmanager
def serving(router, **app_kw):
    """``router`` served by `create_app` + `BackgroundServer` on a free loopback port; yields
    ``(url, app)`` and stops the server on exit (the Router stays open)."""
    from tokenrouter_sdk.serve.app import create_app
    from tokenrouter_sdk.serve.server import BackgroundServer

    app = create_app(router, **app_kw)
    server = BackgroundServer(app, "127.0.0.1", 0).start()
    try:
        yield server.url, app
    finally:
        server.stop()
