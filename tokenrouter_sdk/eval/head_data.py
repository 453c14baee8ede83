"""The questions a policy's learned heads saw while they were made, read from the heads' records,
so that an evaluation never scores a head on them by accident.

A learned policy (`CITER`, `R2R`, `CoLLM`, `QueryRouter`) keeps its head's record in
``policy.head_meta`` (`tokenrouter_sdk.policies.heads.HeadRecord`): the training pipelines write
``data.train_ids``, ``data.val_ids`` and ``default_threshold.calibration_ids`` there
(`tokenrouter_sdk.train`). The packaged heads were trained on GSM8K *test* questions 556-855 (the
query head on 128-255), so a GSM8K sweep of them must leave those out.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["record_ids", "head_questions", "excluded_ids"]


def record_ids(meta: dict) -> set[str]:
    """Ids a head's record says it was trained, validated or calibrated on (empty for a record
    without them, e.g. a head built in memory)."""
    if not isinstance(meta, dict):
        return set()
    data = meta.get("data") or {}
    ids = set(data.get("train_ids") or ()) | set(data.get("val_ids") or ())
    ids |= set((meta.get("default_threshold") or {}).get("calibration_ids") or ())
    return {str(i) for i in ids}


def _heads(policy, depth: int = 2):
    """(label, head record) of ``policy`` and of the policies it holds (attributes, lists and dict
    values of them, ``depth`` levels down)."""
    from ..policy import Policy

    meta = getattr(type(policy), "head_meta", None)
    if isinstance(meta, property):
        yield type(policy).__name__, policy.head_meta
    if depth == 0:
        return
    for v in vars(policy).values() if hasattr(policy, "__dict__") else ():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
        for x in items:
            if isinstance(x, Policy) and x is not policy:
                yield from _heads(x, depth - 1)


def head_questions(policy) -> dict[str, set[str]]:
    """Head label (the policy's class name) -> the question ids its record says the head was
    trained, validated or calibrated on, for ``policy`` and the policies it holds; policies
    without a learned head are left out."""
    out: dict[str, set[str]] = {}
    for label, meta in _heads(policy):
        ids = record_ids(meta)
        if ids:
            out.setdefault(label, set()).update(ids)
    return out


def excluded_ids(policies: Iterable) -> tuple[set[str], dict[str, int]]:
    """(every id any of ``policies``' heads saw, head label -> how many ids its record lists)."""
    ids: set[str] = set()
    per: dict[str, int] = {}
    for pol in policies:
        for label, got in head_questions(pol).items():
            ids |= got
            per[label] = max(per.get(label, 0), len(got))
    return ids, per
