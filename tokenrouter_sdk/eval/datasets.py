"""Benchmarks for quality sweeps: GSM8K, MATH-500, AIME 2024, AMC 2023, CommonsenseQA.

The rows and the one prompt template per benchmark come from `tokenrouter_sdk.benchmarks` (the
files shipped with the package first; see there for every source and its order). This module
draws the subset for a sweep (file order or a seeded shuffle) and holds it as a
`datasets.Dataset`; the router applies the model's chat template to each prompt
(`Router.encode`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from tokenrouter_sdk.benchmarks import (
    ALIASES,
    BENCHMARKS,
    CHOICE_TEMPLATE,
    GSM8K_TEMPLATE,
    MATH_TEMPLATE,
    BenchmarkRows,
    BenchmarkSpec,
)
from tokenrouter_sdk.benchmarks import load as load_rows

__all__ = [
    "Benchmark",
    "load_benchmark",
    "BENCHMARKS",
    "ALIASES",
    "BenchmarkSpec",
    "GSM8K_TEMPLATE",
    "MATH_TEMPLATE",
    "CHOICE_TEMPLATE",
]


@dataclass
class Benchmark(BenchmarkRows):
    """A loaded benchmark subset.

    Attributes:
        name: benchmark name (or the file stem of a custom path).
        kind: ``"math"`` or ``"choice"``.
        rows: the rows as a `datasets.Dataset` with columns ``id, question, answer, prompt``
            (and ``meta`` when the source has it).
        source: the file read, or ``datasets-cache:<hub path>``.
        template: the prompt template used.
        limit, seed: how the subset was drawn (None: all rows / file order).
    """

    name: str
    kind: str
    rows: object
    source: str
    template: str
    limit: int | None = None
    seed: int | None = None
    extra: dict = field(default_factory=dict)

    def column(self, name: str) -> list:
        return list(self.rows[name])

    @property
    def prompts(self) -> list[str]:
        """User-message text per question (the router adds the chat template)."""
        return self.column("prompt")

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def to_pandas(self):
        return self.rows.to_pandas()

    def describe(self) -> dict:
        """JSON-able description (recorded in sweep results, and part of each point's
        configuration hash): ``excluded`` only when questions were left out, so a sweep whose
        heads leave none out resumes the points of one without heads."""
        out = {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "n": len(self),
            "limit": self.limit,
            "seed": self.seed,
            "ids": self.ids,
            "template": self.template,
        }
        if self.extra.get("excluded", {}).get("n"):
            out["excluded"] = self.extra["excluded"]
        return out


@contextlib.contextmanager
def _quiet_progress():
    """No `datasets` progress bars for these tiny loads (restores the previous setting)."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            ds_logging.enable_progress_bar()


def load_benchmark(
    name_or_path: str | os.PathLike = "gsm8k",
    limit: int | None = None,
    seed: int | None = None,
    split: str | None = None,
    template: str | None = None,
    kind: str | None = None,
    exclude=None,
) -> Benchmark:
    """Load a benchmark subset with its prompts.

    Args:
        name_or_path: ``gsm8k``, ``math500``, ``aime24``, ``amc23``, ``commonsenseqa`` (or an
            alias such as ``csqa``), or the path of a JSONL with ``{id, question, answer}`` rows.
        limit: number of questions (None: all).
        seed: None keeps file order (the first ``limit`` rows); an int shuffles with
            `datasets.Dataset.shuffle(seed=...)` before taking ``limit``.
        split: must be None or the split the benchmark's file holds (``test`` for GSM8K and
            MATH-500, ``validation`` for CommonsenseQA, ...): each benchmark has one.
        template: prompt template with ``{question}`` (default: the benchmark's, from
            `tokenrouter_sdk.benchmarks`).
        kind: ``"math"`` or ``"choice"`` to override the answer checker.
        exclude: question ids left out before ``limit`` is taken (e.g. those a learned head was
            trained on): the order (file or seeded shuffle) is the same as without them, and the
            next questions in it take their places, so the subset still holds ``limit``
            questions. How many were left out is in ``.extra["excluded"]``: ``n`` (of the whole
            benchmark), ``in_draw`` (of the ``limit`` questions drawn without exclusion) and
            ``ids`` (those).

    Returns:
        a `Benchmark` (``.prompts``, ``.answers``, ``.ids``, ``.rows``, ``.to_pandas()``).

    Raises:
        ValueError: unknown benchmark (lists the known ones), ``limit < 1``, a template without
            ``{question}``, another split than the benchmark's, or rows without an answer.
        FileNotFoundError: no source has the benchmark (names every place tried).
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None (all rows), got {limit!r}")
    if template is not None and "{question}" not in template:
        raise ValueError(f"template must contain '{{question}}', got {template!r}")
    if kind is not None and kind not in ("math", "choice"):
        raise ValueError(f"kind must be 'math' or 'choice', got {kind!r}")
    exclude = {str(i) for i in exclude} if exclude else set()
    data = load_rows(name_or_path, None if seed is not None or exclude else limit)
    spec = data.spec
    if split is not None and spec.hub is not None and split != spec.hub[2]:
        raise ValueError(f"benchmark {spec.name!r} holds only its {spec.hub[2]!r} split, got split={split!r}")
    if not data.rows:
        raise ValueError(f"{data.source}: no rows; each line needs {{id, question, answer}}")
    if any(r["answer"] == "" for r in data.rows):
        raise ValueError(f"{data.source}: rows lack ['answer']; each row needs {{id, question, answer}}")
    tpl = template or spec.template
    import datasets

    with _quiet_progress():
        ds = datasets.Dataset.from_list(data.rows)
        if seed is not None:
            ds = ds.shuffle(seed=seed)
        extra = {}
        if exclude:
            order = [str(x) for x in ds["id"]]
            drawn = order[:limit] if limit is not None else order
            hit = [i for i in drawn if i in exclude]
            extra["excluded"] = {
                "n": sum(i in exclude for i in order),
                "in_draw": len(hit),
                "draw": len(drawn),
                "ids": hit,
            }
            ds = ds.select([k for k, i in enumerate(order) if i not in exclude])
            if not len(ds):
                raise ValueError(f"{data.source}: every question is excluded ({len(order)} of them)")
        if limit is not None and len(ds) > limit:
            ds = ds.select(range(limit))
        ds = ds.map(lambda r: {"prompt": tpl.format(question=r["question"])})
    return Benchmark(spec.name, kind or spec.kind, ds, data.source, tpl, limit, seed, extra)
