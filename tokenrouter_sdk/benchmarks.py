"""Benchmark questions and prompt templates, for every part of the package: the demo and
``tokenrouter bench`` (`load_prompts`), training (`tokenrouter_sdk.train.data`), distillation
(`tokenrouter_sdk.train.self_draft`), evaluation (`tokenrouter_sdk.eval.load_benchmark`), the scripts in
``evals/`` and the tutorials.

One spec per benchmark (`BENCHMARKS`): its name, file, answer kind (``"math"``: final answer
checked with Math-Verify; ``"choice"``: a letter) and its one prompt template. Rows have the schema
``{"id": str, "question": str, "answer": str, "meta": dict}``.

Where rows come from (the first that exists wins; `load` names the one used in ``.source``):

1. an explicit JSONL ``path``, or ``<data_dir>/<file>`` (``data_dir`` argument, else the folder
   in ``$TOKENROUTER_DATA``): a local folder may always be passed explicitly;
2. the file shipped in ``tokenrouter_sdk/data/`` (GSM8K test and train, MATH-500, AIME 2024,
   AMC 2023; MIT; gzip, its sha256 checked on every read);
3. the hub copy already in the `datasets` cache, read offline (no network).

No folder outside the package is searched unless it is named (1), so every clone reads the same
questions. ``gsm8k`` is GSM8K's test split (what evaluations score); ``gsm8k_train`` its train split
(7,473 questions, ids ``gsm8k-train-0000`` ..), the default of training (`tokenrouter_sdk.train`), so
that training and evaluation never share a question by accident. CommonsenseQA is not shipped (no licence is stated
for its file): it loads from 1 or 3.

```python
from tokenrouter_sdk.benchmarks import load, load_prompts
gsm = load("gsm8k", limit=8)          # .ids, .questions, .answers, .prompts, .rows, .source
prompts = load_prompts("gsm8k", 8)    # the same 8 questions in the GSM8K template
```
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

PACKAGED_DIR = Path(__file__).resolve().parent / "data"

GSM8K_TEMPLATE = (
    "Solve the following math word problem step by step. End with a line "
    '"The answer is N." where N is the final number.\n\nQuestion: {question}'
)
MATH_TEMPLATE = "Solve the following problem step by step. Put your final answer within \\boxed{{}}.\n\n{question}"
CHOICE_TEMPLATE = (
    "Answer the following multiple-choice question. Think briefly, then end with "
    '"The answer is (X)." where X is the letter of the correct choice.\n\nQuestion: {question}'
)


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to find and prompt one benchmark.

    Attributes:
        name: short name (``"gsm8k"``).
        file: JSONL file name (``gsm8k_test.jsonl``); shipped as ``<file>.gz`` when ``sha256`` is set.
        kind: ``"math"`` or ``"choice"`` (which answer check applies).
        template: the prompt template, with a ``{question}`` field.
        sha256: sha256 of the decompressed shipped file (hex), or None when not shipped.
        rows: number of rows of the shipped file (None when not shipped).
        hub: ``(path, config, split)`` of the hub copy, read from the `datasets` cache only.
    """

    name: str
    file: str
    kind: str
    template: str
    sha256: str | None = None
    rows: int | None = None
    hub: tuple[str, str | None, str] | None = None

    @property
    def packaged(self) -> Path | None:
        """The shipped ``.jsonl.gz`` file, or None when this benchmark is not shipped."""
        return PACKAGED_DIR / f"{self.file}.gz" if self.sha256 else None

    def prompt(self, question: str) -> str:
        """The user-message text for one question (the router adds the chat template)."""
        return self.template.format(question=question)


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "gsm8k": BenchmarkSpec(
        "gsm8k",
        "gsm8k_test.jsonl",
        "math",
        GSM8K_TEMPLATE,
        "31a83d6aa716809a11e017ae9c667b5db7d0cc68c21ab11f8b73444c8a6bf5d3",
        1319,
        ("openai/gsm8k", "main", "test"),
    ),
    "gsm8k_train": BenchmarkSpec(
        "gsm8k_train",
        "gsm8k_train.jsonl",
        "math",
        GSM8K_TEMPLATE,
        "a7938272ceef0dc84175e722a99bf3d2b3014dba67cd270dd3ab25106806eae3",
        7473,
        ("openai/gsm8k", "main", "train"),
    ),
    "math500": BenchmarkSpec(
        "math500",
        "math500_test.jsonl",
        "math",
        MATH_TEMPLATE,
        "5cd442a9fa433d74dbe690c52c532959f28a6fd819fbfd42c16a446b1e60789b",
        500,
        ("HuggingFaceH4/MATH-500", None, "test"),
    ),
    "aime24": BenchmarkSpec(
        "aime24",
        "aime24.jsonl",
        "math",
        MATH_TEMPLATE,
        "763f4f66be8e584bdb81414d67b6dee7fe9e00c98361ae50bc026a640a0eaf8d",
        30,
        ("HuggingFaceH4/aime_2024", None, "train"),
    ),
    "amc23": BenchmarkSpec(
        "amc23",
        "amc23.jsonl",
        "math",
        MATH_TEMPLATE,
        "160b789af28b38c18d7f795d03b892481d6b13e4403349f916375bec0b72679e",
        40,
        ("math-ai/amc23", None, "test"),
    ),
    "commonsenseqa": BenchmarkSpec(
        "commonsenseqa",
        "commonsenseqa_validation.jsonl",
        "choice",
        CHOICE_TEMPLATE,
        hub=("tau/commonsense_qa", None, "validation"),
    ),
}
ALIASES = {
    "gsm8k_test": "gsm8k",
    "gsm8k-test": "gsm8k",
    "gsm8k-train": "gsm8k_train",
    "math-500": "math500",
    "math_500": "math500",
    "aime": "aime24",
    "aime2024": "aime24",
    "amc": "amc23",
    "amc2023": "amc23",
    "csqa": "commonsenseqa",
    "commonsense_qa": "commonsenseqa",
}


def get_spec(name: str) -> BenchmarkSpec:
    """The spec of a benchmark name or alias (case-insensitive).

    Raises:
        ValueError: an unknown name (lists the known ones).
    """
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in BENCHMARKS:
        raise ValueError(
            f"unknown benchmark {name!r}: use one of {', '.join(BENCHMARKS)} (or an alias: "
            f"{', '.join(ALIASES)}), or the path of a JSONL file with {{id, question, answer}} rows"
        )
    return BENCHMARKS[key]


def spec_for_path(path: str | os.PathLike) -> BenchmarkSpec:
    """The spec used for a JSONL file: a file whose name contains a known benchmark's name (or
    is its file name) gets that benchmark's kind and template; any other file is a math set
    named after its stem, with the MATH template."""
    p = Path(path)
    stem = p.name.lower()
    known = next((b for b in BENCHMARKS.values() if b.name in stem or b.file == p.name), None)
    if known:
        return BenchmarkSpec(known.name, p.name, known.kind, known.template)
    return BenchmarkSpec(p.stem.removesuffix(".jsonl"), p.name, "math", MATH_TEMPLATE)


class BenchmarkRows:
    """The columns of a benchmark's rows (``id``, ``question``, ``answer``) as lists, for a class
    whose ``rows`` holds them and whose `column` reads one."""

    rows: object

    def column(self, name: str) -> list:
        """The values of column ``name``, in row order."""
        raise NotImplementedError

    @property
    def ids(self) -> list[str]:
        return [str(x) for x in self.column("id")]

    @property
    def questions(self) -> list[str]:
        return list(self.column("question"))

    @property
    def answers(self) -> list[str]:
        return [str(x) for x in self.column("answer")]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class BenchmarkData(BenchmarkRows):
    """Rows of one benchmark.

    Attributes:
        spec: the benchmark's spec (its template builds `prompts`).
        rows: ``{"id", "question", "answer", "meta"}`` dicts, in file order.
        source: the file read (a path) or ``datasets-cache:<hub path>``.
    """

    spec: BenchmarkSpec
    rows: list[dict] = field(default_factory=list)
    source: str = ""

    def column(self, name: str) -> list:
        return [r[name] for r in self.rows]

    @property
    def prompts(self) -> list[str]:
        """User-message text per question, from the spec's template."""
        return [self.spec.prompt(r["question"]) for r in self.rows]


def _parse_jsonl(text: str, source: str, name: str, limit: int | None) -> list[dict]:
    rows = []
    for n, line in enumerate(text.split("\n")):  # JSON Lines: "\n" ends a row (a question may hold U+2028)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{source}: line {n + 1} is not JSON ({e.msg}); expected one "
                "{id, question, answer, meta} object per line"
            ) from e
        if not isinstance(row, dict) or "question" not in row:
            raise ValueError(
                f"{source}: line {n + 1} has no 'question' field (expected {{id, question, answer, meta}}}} per line)"
            )
        answer = row.get("answer", "")
        rows.append(
            {
                "id": str(row.get("id", f"{name}-{len(rows)}")),
                "question": str(row["question"]),
                "answer": "" if answer is None else str(answer),
                "meta": row.get("meta") or {},
            }
        )
        if limit is not None and len(rows) >= limit:
            break
    return rows


def read_packaged(spec: BenchmarkSpec) -> str:
    """The decompressed text of a shipped file, after checking its sha256.

    Raises:
        FileNotFoundError: the benchmark is not shipped, or its file is missing from the install.
        ValueError: the file's content does not match the sha256 in `BENCHMARKS` (a damaged or
            edited file; reinstall the package).
    """
    p = spec.packaged
    if p is None or not p.is_file():
        raise FileNotFoundError(
            f"benchmark {spec.name!r}: no shipped file" + (f" at {p} (reinstall tokenrouter-sdk)" if p else "")
        )
    raw = gzip.decompress(p.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != spec.sha256:
        raise ValueError(
            f"{p}: sha256 {digest} does not match the expected {spec.sha256}; the shipped file is "
            "damaged or was edited: reinstall tokenrouter-sdk, or pass your own file as path="
        )
    return raw.decode("utf-8")


def _read_file(p: Path) -> str:
    data = p.read_bytes()
    return (gzip.decompress(data) if p.suffix == ".gz" else data).decode("utf-8")


@contextlib.contextmanager
def _datasets_offline():
    """`datasets` with the hub switched off for the duration (its cache is still read)."""
    import datasets.config as cfg

    old = cfg.HF_HUB_OFFLINE
    cfg.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        cfg.HF_HUB_OFFLINE = old


def _from_datasets_cache(spec: BenchmarkSpec) -> list[dict]:
    """The hub copy mapped to the row schema, from the `datasets` cache only.

    Raises:
        ImportError: `datasets` is not installed.
        Exception: whatever `datasets` raises when the copy is not cached.
    """
    import datasets
    from datasets.utils import logging as ds_logging

    path, config, split = spec.hub
    was = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        with _datasets_offline():
            ds = datasets.load_dataset(path, config, split=split)
    finally:
        if was:
            ds_logging.enable_progress_bar()
    rows = []
    for i, row in enumerate(ds):
        q = row.get("question") or row.get("problem") or ""
        a = row.get("answer", row.get("answerKey", ""))
        meta = {"index": i}
        rid = row.get("id", row.get("unique_id"))
        if spec.name in ("gsm8k", "gsm8k_train"):
            meta |= {"solution": str(a), "answer_raw": str(a).split("####")[-1].strip()}
            a = meta["answer_raw"].replace(",", "")
            rid = f"gsm8k-{split}-{i:04d}"
        if spec.name == "commonsenseqa":
            ch = row["choices"]
            q += "\nAnswer Choices: " + " ".join(f"({lab}) {t}" for lab, t in zip(ch["label"], ch["text"]))
        rows.append(
            {"id": str(rid if rid is not None else f"{spec.name}-{i}"), "question": q, "answer": str(a), "meta": meta}
        )
    return rows


def load(
    name_or_path: str | os.PathLike = "gsm8k",
    limit: int | None = None,
    *,
    path: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
) -> BenchmarkData:
    """Rows of a benchmark, from the first source that has it (module docstring).

    Args:
        name_or_path: a benchmark name or alias (``gsm8k``, ``math500``, ``aime24``, ``amc23``,
            ``commonsenseqa``, ``csqa``, ...) or the path of a JSONL file (``.jsonl`` or
            ``.jsonl.gz``) with ``{id, question, answer, meta}`` rows.
        limit: the first ``limit`` rows in file order (None: all).
        path: a JSONL file to read for the named benchmark (its spec still gives the template).
        data_dir: a local folder holding ``<file>`` (default ``$TOKENROUTER_DATA`` when set).

    Returns:
        a `BenchmarkData` (``.rows``, ``.ids``, ``.questions``, ``.answers``, ``.prompts``,
        ``.source``).

    Raises:
        ValueError: unknown benchmark name, ``limit < 1``, a row without ``question``, or a shipped
            file whose sha256 does not match.
        FileNotFoundError: an explicit ``path`` that does not exist, or no source has the
            benchmark (lists every place tried).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None (all rows), got {limit!r}")
    s = str(name_or_path)
    looks_like_path = bool(Path(s).suffix) or os.sep in s or Path(s).is_file()
    if path is None and looks_like_path and ALIASES.get(s.lower(), s.lower()) not in BENCHMARKS:
        path = Path(s).expanduser()
        spec = spec_for_path(path)
    else:
        spec = get_spec(s)
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(
                f"benchmark file {str(path)!r} not found: pass the path of a JSONL file with "
                "{id, question, answer} rows"
            )
        return BenchmarkData(spec, _parse_jsonl(_read_file(p), str(p), spec.name, limit), str(p.resolve()))

    tried = []
    folder = data_dir if data_dir is not None else os.environ.get("TOKENROUTER_DATA")
    if folder:
        p = Path(folder).expanduser() / spec.file
        if p.is_file():
            return BenchmarkData(spec, _parse_jsonl(_read_file(p), str(p), spec.name, limit), str(p.resolve()))
        tried.append(f"{p} ({'data_dir' if data_dir is not None else '$TOKENROUTER_DATA'}: no such file)")
    if spec.packaged is not None:
        if spec.packaged.is_file():
            return BenchmarkData(
                spec, _parse_jsonl(read_packaged(spec), str(spec.packaged), spec.name, limit), str(spec.packaged)
            )
        tried.append(f"{spec.packaged} (shipped file missing from this install)")
    else:
        tried.append(f"shipped files ({spec.name} is not shipped)")
    if spec.hub is not None:
        try:
            rows = _from_datasets_cache(spec)
        except Exception as e:  # noqa: BLE001 - not installed, not cached: all mean "not available here"
            tried.append(f"the datasets cache of {spec.hub[0]!r} (not available: {type(e).__name__}: {str(e)[:160]})")
        else:
            return BenchmarkData(spec, rows[:limit] if limit else rows, f"datasets-cache:{spec.hub[0]}")
    raise FileNotFoundError(
        f"benchmark {spec.name!r} not found; tried: "
        + "; ".join(tried)
        + f". Pass path=<a JSONL file> or data_dir=<a folder holding {spec.file}>"
    )


def load_prompts(
    source: str | os.PathLike = "gsm8k", n: int | None = None, *, template: str | None = None
) -> list[str]:
    """The first ``n`` prompts of a benchmark or file, ready for `Router.generate`.

    Args:
        source: a benchmark name or alias, a JSONL file (its questions in the template of the
            benchmark its name contains, else the MATH template), or any other text file (one
            prompt per non-empty line, used as is).
        n: number of prompts (None: all).
        template: a template with ``{question}`` to use instead of the benchmark's (JSONL only).

    Raises:
        ValueError: unknown benchmark, ``n < 1``, or a template without ``{question}``.
        FileNotFoundError: as `load`.
    """
    if template is not None and "{question}" not in template:
        raise ValueError(f"template must contain '{{question}}', got {template!r}")
    p = Path(source)
    if p.suffix not in (".jsonl", ".gz", ".json") and p.is_file():
        if n is not None and n < 1:
            raise ValueError(f"n must be a positive int or None (all prompts), got {n!r}")
        lines = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
        return lines[:n] if n is not None else lines
    data = load(source, n)
    tpl = template or data.spec.template
    return [tpl.format(question=q) for q in data.questions]
