"""`evaluate` metric modules shipped with the package (``math_accuracy``, ``choice_accuracy``).

Each lives in its own folder, as `evaluate.load` expects (``<name>/<name>.py``); load one with
`load_metric` (works offline, no hub)."""

from __future__ import annotations

from pathlib import Path

METRICS = ("math_accuracy", "choice_accuracy")


def metric_path(name: str) -> Path:
    """Folder of a packaged metric module.

    Raises:
        ValueError: unknown name (lists the packaged ones).
    """
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; packaged metrics: {', '.join(METRICS)}")
    return Path(__file__).resolve().parent / name


def load_metric(name: str):
    """``evaluate.load`` of a packaged metric module by name (offline), e.g.
    ``load_metric("math_accuracy").compute(predictions=[...], references=[...])``."""
    import evaluate

    return evaluate.load(str(metric_path(name)))
