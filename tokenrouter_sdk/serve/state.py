"""What one server holds: its Router, its model id, its policies (the default one and the
registry that per-request ``policy`` fields are built from, with a bounded cache of built
ones), its metrics and the requests it is serving now."""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..policies.registry import PolicyRegistry, PolicySpecError, parse_spec
from ..policy import Policy
from .errors import APIError, bad_request

MAX_BODY_BYTES = 4 * 1024 * 1024


class PolicyCache:
    """Policies built from per-request specs, keyed by their canonical spec; at most ``size``
    (least recently used dropped first), so a client sending many specs cannot grow memory.
    Reusing one instance per spec lets the engine register it once per call, as for a Router's
    own policy.

    Args:
        registry: where names are looked up.
        size: policies kept at most.
    """

    def __init__(self, registry: PolicyRegistry, size: int = 64):
        self.registry, self.size = registry, size
        self._items: collections.OrderedDict[str, Policy] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: str | Mapping) -> tuple[Policy, str]:
        """The policy for a client's spec and its canonical label (``name:k=v,...``).

        Raises:
            APIError: 400 naming ``policy`` (unknown name, bad argument, a file argument).
        """
        try:
            entry, kwargs = self.registry.resolve(spec, allow_paths=False)
        except PolicySpecError as e:
            raise bad_request("policy", f"policy: {e}", "invalid_policy") from None
        label = entry.name + (
            ":" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(kwargs.items())) if kwargs else ""
        )
        with self._lock:
            pol = self._items.get(label)
            if pol is not None:
                self._items.move_to_end(label)
                return pol, label
        try:
            pol = entry.cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - the policy's own argument check
            raise bad_request("policy", f"policy '{label}': {type(e).__name__}: {e}", "invalid_policy") from None
        with self._lock:
            self._items[label] = pol
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return pol, label


@dataclass
class ServeState:
    """One server's state (``app.state.tr``).

    Attributes:
        router: the `Router` served.
        model_id: the id clients send as ``model`` for routed generation.
        policy, policy_label: the default policy and how it is shown.
        policies: per-request policies (`PolicyCache`).
        metrics: the server's `tokenrouter_sdk.serve.prometheus_metrics.ServerMetrics`.
        max_body_bytes: larger request bodies are refused (413) before parsing.
        active: the `Generation` objects of requests being served (aborted when the server stops).
        restarts: its `tokenrouter_sdk.serve.restart.AutoRestart` (restarts of dead sub-servers).
    """

    router: Any
    model_id: str
    policy: Policy
    policy_label: str
    policies: PolicyCache
    metrics: Any
    max_body_bytes: int = MAX_BODY_BYTES
    active: set = field(default_factory=set)
    restarts: Any = None

    def resolve(self, model: str | None, spec) -> tuple[Policy, str]:
        """The policy of a request from its ``model`` and ``policy`` fields: a sub-model's name as
        ``model`` pins every token to that model; ``policy`` overrides the default by name.

        Raises:
            APIError: 404 unknown model (lists the ids), 400 a bad policy or both given.
        """
        models = list(self.router.models)
        if model is not None and model != self.model_id and model not in models:
            raise APIError(
                404,
                f"model '{model}' does not exist; this server serves '{self.model_id}' (routed) "
                f"and {models} (one model each); see GET /v1/models",
                "model",
                "model_not_found",
            )
        if model in models and model != self.model_id:
            if spec is not None:
                raise bad_request(
                    "policy",
                    f"model '{model}' names one sub-model, which writes every token; a "
                    f"policy needs model '{self.model_id}'",
                )
            return self.policies.get({"name": "single", "model": model})
        if spec is None or spec == "default" or spec == "":
            return self.policy, self.policy_label
        if isinstance(spec, str):
            try:
                parse_spec(spec)
            except PolicySpecError as e:
                raise bad_request("policy", f"policy: {e}", "invalid_policy") from None
        return self.policies.get(spec)
