"""The engine below the Router, in three rooms around one seam.

- The seam (this package's own modules): `config` (`EngineConfig`), `messages` (what travels
  between the engine and the sub-servers, and the events of the trace), `runner` (the `Runner`,
  `RunnerSpec` and `Transport` protocols) and `step_result`.
- `front`: what a user's requests meet: `front.engine.Engine` (submission, admission, outputs,
  abort, the event trace), calls, handles, KV admission, detokenization, committed-token metrics.
- `core`: what serves one model: `core.subserver.SubServer`, its scheduler, KV blocks, prefix
  cache, forward, sampler and commit rules, and `core.policy_host`, the one module that calls a
  policy's hooks (for the sub-server, and for the front's submission).
- `transports`: how messages move: threads, processes through one hub, Ray actors, simulated time.

Imports go seam <- core <- transports <- front (`tests/unit/test_import_graph.py` holds it). The
names users reach for are importable from here; each loads its module on first use, so importing
this package loads nothing else.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineConfig": "config",
    "Engine": "front.engine",
    "EngineDeadError": "front.engine",
    "Call": "front.call",
    "RequestHandle": "front.request_handle",
    "SubServer": "core.subserver",
    "Runner": "runner",
    "RunnerSpec": "runner",
    "RunnerInfo": "runner",
    "SeqInput": "runner",
    "ForwardOut": "runner",
    "Transport": "runner",
    "ThreadTransport": "transports.transport",
    "ProcessTransport": "transports.process_transport",
    "RayTransport": "transports.ray_transport",
    "SimTransport": "transports.sim_transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """``tokenrouter_sdk.engine.<Name>`` for the names in `__all__`, imported on first use.

    Raises:
        AttributeError: ``name`` is not one of them.
    """
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'tokenrouter_sdk.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{where}"), name)
