"""Serving a `Router` over HTTP, OpenAI-compatible (``pip install tokenrouter-sdk[serve]``).

``tokenrouter serve`` (`tokenrouter_sdk.cli.serve`) runs it from a shell; ``router.serve()``
starts it in the background of a notebook on the Router's own engine. Endpoints, the
``tokenrouter`` extension field and the metrics are described in docs/serving.md.

- `create_app` (`tokenrouter_sdk.serve.app`): the FastAPI app of a Router.
- `BackgroundServer`, `serve_forever` (`tokenrouter_sdk.serve.server`): running it.
- `ServerMetrics` (`tokenrouter_sdk.serve.prometheus_metrics`): its Prometheus registry.
- `AutoRestart` (`tokenrouter_sdk.serve.restart`): a dead sub-server restarted, up to a limit.

The ``tokenrouter`` model type of lm-evaluation-harness is `tokenrouter_sdk.eval.lm_eval_model`.

Importing this package imports neither FastAPI nor uvicorn; the names above load on first use.
"""

from __future__ import annotations

_LAZY = {
    "create_app": "app",
    "close_app": "app",
    "BackgroundServer": "server",
    "serve_forever": "server",
    "ServerMetrics": "metrics",
    "AutoRestart": "restart",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
