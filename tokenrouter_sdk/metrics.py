"""Committed-token metrics of a call: `Metrics` (run level) and `ModelMetrics` (per model),
computed from the call's events by `compute_metrics`. They are defined with the engine that
produces those events (`tokenrouter_sdk.engine.front.committed_metrics`); this is their public place."""

from .engine.front.committed_metrics import Metrics, ModelMetrics, compute_metrics

__all__ = ["Metrics", "ModelMetrics", "compute_metrics"]
