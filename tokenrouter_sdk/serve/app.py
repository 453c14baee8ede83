"""`create_app`: the FastAPI application serving one `Router` (its endpoints are in
`tokenrouter_sdk.serve.routes`)."""

from __future__ import annotations

import time

from ..policies.registry import PolicyRegistry, builtin_registry
from ..policy import Policy
from .state import MAX_BODY_BYTES, PolicyCache, ServeState


def create_app(
    router,
    *,
    policy: Policy | str | None = None,
    policy_label: str | None = None,
    registry: PolicyRegistry | None = None,
    model_id: str = "tokenrouter",
    max_body_bytes: int = MAX_BODY_BYTES,
    restart_limit: int = 0,
):
    """The OpenAI-compatible app of ``router``.

    Args:
        router: the `Router` to serve (its engine is shared with every other use of it).
        policy: the default policy of requests without a ``policy`` field: a `Policy`, a registry
            spec (``"rstitch:tau=0.1"``), or None: the Router's.
        policy_label: how responses and ``/v1/models`` name it (None: the spec, or its ``repr``).
        registry: the policies a request may name (None: the built-in ones,
            `tokenrouter_sdk.policies.registry.builtin_registry`).
        model_id: the ``model`` id clients use for routed generation; each sub-model's name
            is served too (all tokens from that model).
        max_body_bytes: larger request bodies are refused with 413 before parsing.
        restart_limit: a sub-server that dies is restarted (`Router.restart`), at most this many
            times per model, each logged on the ``tokenrouter.serve`` logger
            (`tokenrouter_sdk.serve.restart.AutoRestart`); 0 (default): none, ``/health``
            answers 503 from the death on.

    Raises:
        PolicySpecError: ``policy`` is a spec naming no policy of ``registry`` or a bad argument.
        ValueError: ``restart_limit`` is not an int >= 0.

    Returns:
        a FastAPI app; ``app.state.tr`` is its `ServeState`. Call `close_app` when done with it
        (stops its metrics observer, aborts its requests).
    """
    from fastapi import FastAPI

    from .errors import install_handlers
    from .prometheus_metrics import ServerMetrics
    from .restart import AutoRestart
    from .routes import api

    registry = registry if registry is not None else builtin_registry()
    if isinstance(policy, str):
        policy_label = policy_label or policy
        policy = registry.build(policy)
    pol = policy if policy is not None else router.policy
    restarts = AutoRestart(router, restart_limit)  # first: a bad limit leaves nothing behind
    app = FastAPI(
        title="tokenrouter",
        description="OpenAI-compatible token-level routing server",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.tr = ServeState(
        router=router,
        model_id=model_id,
        policy=pol,
        policy_label=policy_label or repr(pol),
        policies=PolicyCache(registry),
        metrics=ServerMetrics(router),
        max_body_bytes=max_body_bytes,
        restarts=restarts,
    )
    app.state.started = time.time()
    install_handlers(app)
    app.include_router(api)
    return app


def close_app(app, reason: str = "the server is stopping") -> None:
    """Abort the requests ``app`` is serving, stop its metrics observer and its restarts (waiting
    for one under way). Idempotent."""
    st: ServeState = app.state.tr
    for gen in list(st.active):
        gen.abort(reason)
    st.metrics.close()
    if st.restarts is not None:
        st.restarts.close()
