"""Training pipelines for the learned routers: R2R (`train_r2r`), CITER
(`train_citer`), Co-LLM (`train_co_llm`) and the query-level router (`train_query`). The
self-draft small model of the packaged pair is trained by `tokenrouter_sdk.train.self_draft`
(``tokenrouter distill``).

Each takes a `Router` (or ``{"small": m, "large": M}`` plus ``tokenizer``) and training prompts
(default: GSM8K train questions, shipped with the package, so that no evaluation question is
trained on; ``data="gsm8k"`` reads GSM8K test without its 128 held-out questions), shows tqdm progress
bars, saves the head with `tokenrouter_sdk.policies.heads.save_head` (the file its policy reads)
plus a JSON record (data ids, model pair, hyperparameters, metrics) next to it, and returns a
`TrainResult`. `calibrate_threshold` and `finalize` (``package``) give a trained head its
default threshold for a target large fraction, calibrated in the engine, and write it for use
(``--package``: where the learned policies find their default heads). CLI:
``tokenrouter train {r2r,citer,co_llm,query}``. Nothing is imported from torch-heavy modules
until a function is called.
"""

from __future__ import annotations

__all__ = [
    "train_r2r",
    "train_citer",
    "train_co_llm",
    "train_query",
    "TrainResult",
    "load_examples",
    "Example",
    "HELDOUT_IDS",
    "DEFAULT_DATA",
    "calibrate_threshold",
    "finalize",
]


def __getattr__(name):
    if name == "train_r2r":
        from .r2r import train_r2r

        return train_r2r
    if name == "train_citer":
        from .citer import train_citer

        return train_citer
    if name == "train_co_llm":
        from .co_llm import train_co_llm

        return train_co_llm
    if name == "train_query":
        from .query import train_query

        return train_query
    if name == "TrainResult":
        from .common import TrainResult

        return TrainResult
    if name in ("calibrate_threshold", "finalize"):
        from . import package

        return getattr(package, name)
    if name in ("load_examples", "Example", "HELDOUT_IDS", "DEFAULT_DATA"):
        from . import data

        return getattr(data, name)
    raise AttributeError(f"module 'tokenrouter_sdk.train' has no attribute {name!r}")
