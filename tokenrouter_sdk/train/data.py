"""Training data for the router pipelines: GSM8K-style JSONL examples, the held-out split, gold
chain-of-thought responses and the answer check.

Questions and their prompt template come from `tokenrouter_sdk.benchmarks`. The default is
GSM8K's train split shipped with the package (`DEFAULT_DATA` = ``"gsm8k_train"``, 7,473
questions, ids ``gsm8k-train-0000`` ..), in the same template as evaluation and the demo, so
that a head never trains on a question the evaluations score (GSM8K test, ``"gsm8k"``).

Held out (fixed, stated in every run's ``meta``): when training reads GSM8K *test* (``data=
"gsm8k"``, as the packaged heads did), its first 128 questions (ids ``gsm8k-test-0000`` ..
``gsm8k-test-0127``) are reserved for evaluation (``evals/quality/policy_table.py``) and never
used for training. Within the training questions a seeded split by question (never by token)
gives validation questions for thresholds and early stopping. An evaluation of a policy with a
learned head leaves out the questions its record says it trained or validated on
(`tokenrouter_sdk.eval.evaluate_policy`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from tokenrouter_sdk import benchmarks

DEFAULT_DATA = "gsm8k_train"  # the benchmark training reads by default (`tokenrouter_sdk.benchmarks`)
HELDOUT = 128
HELDOUT_IDS = frozenset(f"gsm8k-test-{i:04d}" for i in range(HELDOUT))
_CALC = re.compile(r"<<[^<>]*>>")


@dataclass
class Example:
    """One training question.

    Attributes:
        id: the data set's id (e.g. ``gsm8k-test-0040``).
        prompt: the text given to the models (the question in its benchmark's template,
            `tokenrouter_sdk.benchmarks`).
        answer: the gold final answer (e.g. ``"18"``); ``""`` if unknown.
        solution: the gold chain of thought ending with the answer (CITER and Co-LLM teacher-force
            it); ``""`` if the data has none.
    """

    id: str
    prompt: str
    answer: str = ""
    solution: str = ""
    meta: dict = field(default_factory=dict)


def gold_response(solution: str, answer: str) -> str:
    """A GSM8K solution as a model response: calculator annotations ``<<...>>`` removed and the
    ``#### 18`` line written as ``The answer is 18.`` (what the answer check reads)."""
    text = _CALC.sub("", solution or "").strip()
    if "####" in text:
        body, _, final = text.rpartition("####")
        text = body.rstrip() + f"\nThe answer is {final.strip()}."
    elif answer and not text:
        text = f"The answer is {answer}."
    return text


def load_examples(
    path=None, limit: int | None = None, *, exclude_heldout: bool = True, template: str | None = None, offset: int = 0
) -> list[Example]:
    """Training examples from GSM8K train (shipped with the package), another benchmark by name, or
    a JSONL file with ``{id, question, answer, meta: {solution}}`` rows, read by
    `tokenrouter_sdk.benchmarks.load`.

    Args:
        path: a JSONL file or a benchmark name (``"gsm8k"`` is GSM8K test, what the packaged
            heads trained on); None = `DEFAULT_DATA`, GSM8K train.
        limit: keep at most this many examples (after the held-out ones are dropped).
        exclude_heldout: drop ids in `HELDOUT_IDS` (the 128 evaluation questions of GSM8K test;
            no train question has such an id).
        template: prompt template with ``{question}`` (default: the benchmark's template, the
            GSM8K one for GSM8K).
        offset: skip the dataset's first ``offset`` rows (``offset=556`` with ``path="gsm8k"``
            starts at ``gsm8k-test-0556``).

    Raises:
        FileNotFoundError: ``path`` does not exist (names it and how to pass one).
        ValueError: a row without ``question``, a template without ``{question}``, a negative
            ``offset``, or no example left.
    """
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if template is not None and "{question}" not in template:
        raise ValueError(f"template must contain '{{question}}', got {template!r}")
    data = benchmarks.load(DEFAULT_DATA if path is None else path)
    tpl = template or data.spec.template
    out = []
    for row in data.rows[offset:]:
        if exclude_heldout and row["id"] in HELDOUT_IDS:
            continue
        out.append(
            Example(
                row["id"],
                tpl.format(question=row["question"]),
                row["answer"],
                gold_response(row["meta"].get("solution", ""), row["answer"]),
                row["meta"],
            )
        )
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(
            f"{data.source}: no training examples left (limit={limit}, offset={offset}, "
            f"exclude_heldout={exclude_heldout})"
        )
    return out


def as_examples(prompts) -> list[Example]:
    """Examples from a list of `Example`, dicts ``{id?, prompt|question, answer?, solution?}`` (a
    ``question`` is put in the GSM8K template) or plain prompt strings (ids ``prompt-0000`` ...).

    Raises:
        ValueError: a dict without ``prompt`` or ``question``, or an empty list.
        TypeError: an item of another type.
    """
    out = []
    for i, x in enumerate(prompts):
        if isinstance(x, Example):
            out.append(x)
        elif isinstance(x, str):
            out.append(Example(f"prompt-{i:04d}", x))
        elif isinstance(x, dict):
            prompt = x.get("prompt")
            if prompt is None and "question" in x:
                prompt = benchmarks.get_spec("gsm8k").prompt(x["question"])
            if prompt is None:
                raise ValueError(f"example {i}: a dict needs 'prompt' or 'question', got keys {sorted(x)}")
            out.append(
                Example(
                    str(x.get("id", f"prompt-{i:04d}")),
                    prompt,
                    str(x.get("answer", "")),
                    x.get("solution", ""),
                    x.get("meta", {}),
                )
            )
        else:
            raise TypeError(f"example {i}: expected an Example, a dict or a str, got {type(x).__name__}")
    if not out:
        raise ValueError("no training prompts given")
    return out


def split(examples: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Seeded split by example -> ``(train, val)``; val holds round(n * val_fraction) examples,
    at least 1 when n >= 2 and val_fraction > 0."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    idx = list(range(len(examples)))
    random.Random(seed).shuffle(idx)
    k = round(len(idx) * val_fraction)
    if val_fraction > 0 and len(idx) >= 2:
        k = max(1, min(k, len(idx) - 1))
    val = set(idx[:k])
    return [e for i, e in enumerate(examples) if i not in val], [e for i, e in enumerate(examples) if i in val]


def _fallback_correct(output: str, reference: str) -> bool:
    """Last-number check used only when tokenrouter_sdk.eval.answers is unavailable."""
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", output or "")
    if not nums or not reference.strip():
        return False
    try:
        return abs(float(nums[-1].replace(",", "")) - float(reference.replace(",", ""))) < 1e-6
    except ValueError:
        return nums[-1].replace(",", "") == reference.strip()


def is_correct(output: str, example: Example) -> bool:
    """Whether ``output``'s final answer equals ``example.answer``
    (`tokenrouter_sdk.eval.answers.is_correct`: math-verify; a last-number check without it)."""
    if not example.answer:
        return False
    try:
        from tokenrouter_sdk.eval.answers import is_correct as check
    except ImportError:
        return _fallback_correct(output, example.answer)
    return bool(check(output, example.answer))
