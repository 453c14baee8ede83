"""Benchmarks for quality sweeps: GSM8K, MATH-500, AIME 2024, AMC 2023, CommonsenseQA.

Rows have the schema ``{id, question, answer, meta}``. They are read with Hugging Face
`datasets` from a local JSONL (``../shared/data/<file>`` relative to the cwd or to the repo
root, or any path given), else from the hub (where reachable). Each benchmark has a prompt
template; the router applies the model's chat template to the resulting string
(`Router.encode`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

MATH_TEMPLATE = ("Solve the following problem step by step. Put your final answer within \\boxed{{}}.\n\n"
                 "{question}")
GSM8K_TEMPLATE = ("Solve the following math word problem step by step. End with a line "
                  "\"The answer is N.\" where N is the final number.\n\nQuestion: {question}")
CHOICE_TEMPLATE = ("Answer the following multiple-choice question. Think briefly, then end with "
                   "\"The answer is (X).\" where X is the letter of the correct choice.\n\nQuestion: {question}")


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to find and prompt one benchmark.

    Attributes:
        name: short name (``"gsm8k"``).
        file: local JSONL file name under ``shared/data``.
        kind: ``"math"`` (final answer checked with Math-Verify) or ``"choice"`` (letter).
        template: prompt template with a ``{question}`` field.
        hub: ``(path, config, split)`` for `datasets.load_dataset`, the optional fallback.
    """

    name: str
    file: str
    kind: str
    template: str
    hub: tuple[str, str | None, str] | None = None


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "gsm8k": BenchmarkSpec("gsm8k", "gsm8k_test.jsonl", "math", GSM8K_TEMPLATE, ("openai/gsm8k", "main", "test")),
    "math500": BenchmarkSpec("math500", "math500_test.jsonl", "math", MATH_TEMPLATE,
                             ("HuggingFaceH4/MATH-500", None, "test")),
    "aime24": BenchmarkSpec("aime24", "aime24.jsonl", "math", MATH_TEMPLATE,
                            ("HuggingFaceH4/aime_2024", None, "train")),
    "amc23": BenchmarkSpec("amc23", "amc23.jsonl", "math", MATH_TEMPLATE, ("math-ai/amc23", None, "test")),
    "commonsenseqa": BenchmarkSpec("commonsenseqa", "commonsenseqa_validation.jsonl", "choice", CHOICE_TEMPLATE,
                                   ("tau/commonsense_qa", None, "validation")),
}
ALIASES = {"gsm8k_test": "gsm8k", "math-500": "math500", "math_500": "math500", "aime": "aime24",
           "aime2024": "aime24", "amc": "amc23", "amc2023": "amc23", "csqa": "commonsenseqa",
           "commonsense_qa": "commonsenseqa"}


@dataclass
class Benchmark:
    """A loaded benchmark subset.

    Attributes:
        name: benchmark name (or the file stem of a custom path).
        kind: ``"math"`` or ``"choice"``.
        rows: the rows as a `datasets.Dataset` with columns ``id, question, answer, prompt``
            (and ``meta`` when the source has it).
        source: the file read, or ``hub:<path>``.
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

    @property
    def ids(self) -> list[str]:
        return [str(x) for x in self.rows["id"]]

    @property
    def prompts(self) -> list[str]:
        """User-message text per question (the router adds the chat template)."""
        return list(self.rows["prompt"])

    @property
    def answers(self) -> list[str]:
        return [str(x) for x in self.rows["answer"]]

    @property
    def questions(self) -> list[str]:
        return list(self.rows["question"])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def to_pandas(self):
        return self.rows.to_pandas()

    def describe(self) -> dict:
        """JSON-able description (recorded in sweep results)."""
        return {"name": self.name, "kind": self.kind, "source": self.source, "n": len(self),
                "limit": self.limit, "seed": self.seed, "ids": self.ids, "template": self.template}


def data_dir_candidates() -> list[Path]:
    """Folders searched for local benchmark files: ``$TOKENROUTER_DATA``, then ``../shared/data``
    relative to the cwd and to the repo root."""
    import tokenrouter_sdk
    roots = [Path.cwd(), Path(tokenrouter_sdk.__file__).resolve().parents[1]]
    env = os.environ.get("TOKENROUTER_DATA")
    return ([Path(env)] if env else []) + [r / ".." / "shared" / "data" for r in roots]


def find_local(file: str) -> Path | None:
    """The first existing ``<dir>/<file>`` over `data_dir_candidates`, or None."""
    return next((p.resolve() for d in data_dir_candidates() if (p := d / file).is_file()), None)


def _from_hub(spec: BenchmarkSpec, split: str | None):
    """Hub copy mapped to ``{id, question, answer}``; raises FileNotFoundError when unreachable."""
    import datasets
    path, config, default_split = spec.hub
    try:
        ds = datasets.load_dataset(path, config, split=split or default_split)
    except Exception as e:  # noqa: BLE001 - offline, gated, renamed: all mean "not available"
        dirs = ", ".join(str(d) for d in data_dir_candidates())
        raise FileNotFoundError(
            f"benchmark {spec.name!r}: no local file {spec.file} (searched {dirs}) and the hub dataset "
            f"{path!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}). Put the JSONL "
            f"({{id, question, answer}} per line) in one of those folders, set TOKENROUTER_DATA, or pass "
            f"its path to load_benchmark") from e

    def norm(row, i):
        q = row.get("question") or row.get("problem") or ""
        a = row.get("answer", row.get("answerKey", ""))
        if spec.name == "gsm8k":
            a = str(a).split("####")[-1].strip().replace(",", "")
        if spec.name == "commonsenseqa":
            ch = row["choices"]
            q += "\nAnswer Choices: " + " ".join(f"({lab}) {t}" for lab, t in zip(ch["label"], ch["text"]))
        return {"id": str(row.get("id", row.get("unique_id", f"{spec.name}-{i}"))), "question": q, "answer": str(a)}

    return ds.map(norm, with_indices=True, remove_columns=ds.column_names)


def resolve_benchmark(name_or_path: str | os.PathLike) -> tuple[BenchmarkSpec, Path | None]:
    """(spec, local file or None) for a benchmark name, alias or JSONL path.

    A path whose name contains a known benchmark name gets that benchmark's template and kind
    (``.../commonsenseqa_validation.jsonl`` -> choice); any other path is a math set.

    Raises:
        ValueError: an unknown name that is not an existing file (lists the known ones).
    """
    s = str(name_or_path)
    key = ALIASES.get(s.lower(), s.lower())
    if key in BENCHMARKS:
        spec = BENCHMARKS[key]
        return spec, find_local(spec.file)
    p = Path(s).expanduser()
    if p.is_file():
        stem = p.name.lower()
        known = next((b for b in BENCHMARKS.values() if b.name in stem or b.file == p.name), None)
        spec = known or BenchmarkSpec(p.stem, p.name, "math", MATH_TEMPLATE)
        return BenchmarkSpec(spec.name if known else p.stem, p.name, spec.kind, spec.template), p.resolve()
    raise ValueError(f"unknown benchmark {s!r}: use one of {', '.join(BENCHMARKS)} or the path of a JSONL "
                     f"file with {{id, question, answer}} rows")


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


def load_benchmark(name_or_path: str | os.PathLike = "gsm8k", limit: int | None = None, seed: int | None = None,
                   split: str | None = None, template: str | None = None, kind: str | None = None) -> Benchmark:
    """Load a benchmark subset with its prompts.

    Args:
        name_or_path: ``gsm8k``, ``math500``, ``aime24``, ``amc23``, ``commonsenseqa`` (or an
            alias such as ``csqa``), or the path of a JSONL with ``{id, question, answer}`` rows.
        limit: number of questions (None: all).
        seed: None keeps file order (the first ``limit`` rows); an int shuffles with
            `datasets.Dataset.shuffle(seed=...)` before taking ``limit``.
        split: hub split for the hub fallback (local files hold one split).
        template: prompt template with ``{question}`` (default: the benchmark's).
        kind: ``"math"`` or ``"choice"`` to override the answer checker.

    Returns:
        a `Benchmark` (``.prompts``, ``.answers``, ``.ids``, ``.rows``, ``.to_pandas()``).

    Raises:
        ValueError: unknown benchmark, ``limit < 1``, or a template without ``{question}``.
        FileNotFoundError: no local file and the hub is unreachable (names where it looked).
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None (all rows), got {limit!r}")
    spec, path = resolve_benchmark(name_or_path)
    tpl = template or spec.template
    if "{question}" not in tpl:
        raise ValueError(f"template must contain '{{question}}', got {tpl!r}")
    if kind is not None and kind not in ("math", "choice"):
        raise ValueError(f"kind must be 'math' or 'choice', got {kind!r}")
    with _quiet_progress():
        return _load(spec, path, tpl, limit, seed, split, kind)


def _load(spec, path, tpl, limit, seed, split, kind) -> Benchmark:
    import datasets
    if path is not None:
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
        source = str(path)
    elif spec.hub is not None:
        ds = _from_hub(spec, split)
        source = f"hub:{spec.hub[0]}"
    else:
        raise FileNotFoundError(f"benchmark file {spec.file} not found")
    missing = {"question", "answer"} - set(ds.column_names)
    if missing:
        raise ValueError(f"{source}: rows lack {sorted(missing)}; each row needs {{id, question, answer}}")
    if "id" not in ds.column_names:
        ds = ds.add_column("id", [f"{spec.name}-{i}" for i in range(len(ds))])
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    ds = ds.map(lambda r: {"prompt": tpl.format(question=r["question"]), "answer": str(r["answer"]),
                           "id": str(r["id"])})
    return Benchmark(spec.name, kind or spec.kind, ds, source, tpl, limit, seed)
