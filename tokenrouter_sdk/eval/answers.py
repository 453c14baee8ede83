"""Final-answer extraction and checking for model outputs.

Math sets (GSM8K, MATH-500, AIME, AMC): the answer is, in this order of priority,
1. the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces matched, so nesting such as
   ``\\boxed{\\frac{1}{2}}`` or ``\\boxed{\\boxed{5}}`` works),
2. what follows the last anchor ``####``, ``final answer`` or ``the answer is`` / ``Answer:`` on its
   line,
3. the last number in the text (``1,234`` -> ``1234``, ``-3.5``, ``3/4``).
The extracted strings are compared with `math_verify` (Hugging Face Math-Verify: ``parse`` then
``verify``; LaTeX, fractions, units and thousands separators are normalised there), with a plain
string comparison as fallback.

CommonsenseQA (letters ``A``-``E``): ``\\boxed{B}``, ``answer is (B)`` / ``Answer: B`` /
``option B``, a last ``(B)``, or an output that is only a letter (``B``, ``B.``, ``B)``).

No answer at all gives ``None``; ``None`` is never correct. Two outputs *agree* when their
extracted answers are equivalent, or when neither has an answer.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading

MATH, CHOICE = "math", "choice"
KINDS = (MATH, CHOICE)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANCHOR = re.compile(r"(?:####|final answer\s*(?:is)?\s*[:=]?|the answer is\s*[:=]?|answer\s*[:=])", re.I)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_LATEX = re.compile(r"\\[a-zA-Z]+|\^|_\{|\\\(|\\\[")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"answer kind must be one of {KINDS}, got {kind!r}")


@contextlib.contextmanager
def _quiet_timeout():
    """math_verify's timeouts use ``signal.alarm``, which only works on the main thread; off it,
    run without a timeout and silence the warning math_verify logs about that."""
    if threading.current_thread() is threading.main_thread():
        yield 5
        return
    log = logging.getLogger("math_verify")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield None
    finally:
        log.setLevel(old)


def last_boxed(text: str) -> str | None:
    """Content of the last top-level ``\\boxed{...}`` (or ``\\fbox{...}``) with braces matched;
    an inner box filling the whole content is unwrapped (``\\boxed{\\boxed{5}}`` -> ``5``). None
    if there is none or its braces never close."""
    found, i = None, 0
    while (m := _BOX.search(text, i)) is not None:
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth:
            break
        found, i = text[m.end():j - 1].strip(), j
    if found is not None and (m := _BOX.match(found)) and found.endswith("}"):
        sub = last_boxed(found)
        if sub is not None and len(found[m.end():-1].strip()) == len(sub):
            return sub
    return found


_FRAC = re.compile(r"-?\\[dt]?frac\s*\{[^{}]+\}\s*\{[^{}]+\}")


def _last_number(text: str) -> str | None:
    """The last number or LaTeX fraction in ``text`` (thousands separators removed)."""
    hits = [(m.end(), m.group()) for m in _FRAC.finditer(text)]
    hits += [(m.end(), re.sub(r"[,\s]", "", m.group()))
             for m in _NUMBER.finditer(_FRAC.sub(lambda f: " " * len(f.group()), text))]
    if not hits:
        return None
    return max(hits, key=lambda h: h[0])[1]


def extract_math_answer(text: str | None) -> str | None:
    """The final answer of a math solution as a string (see the module docstring for the
    order of rules), or None when the text holds no answer.

    >>> extract_math_answer("3 + 4 = 7 apples, so the answer is 7.")
    '7'
    >>> extract_math_answer("She makes $1,234 per week.")
    '1234'
    """
    if not text:
        return None
    boxed = last_boxed(text)
    if boxed:
        return boxed
    anchors = list(_ANCHOR.finditer(text))
    if anchors:
        tail = text[anchors[-1].end():].strip().split("\n")[0]
        math = re.search(r"\$([^$]+)\$|\\\((.+?)\\\)", tail)
        inner = (math.group(1) or math.group(2)).strip() if math else ""
        if inner and (_LATEX.search(inner) or re.fullmatch(r"[-\d.,/\s]+", inner)):
            return inner.rstrip(".")
        if _LATEX.search(tail):
            tail = tail.strip().rstrip(".").strip()
            if tail:
                return tail
        num = _NUMBER.search(tail)
        if num:
            return re.sub(r"[,\s]", "", num.group())
    return _last_number(text)


def _parse(s: str):
    import math_verify
    with _quiet_timeout() as t:
        return math_verify.parse(s if "$" in s or "\\boxed" in s else f"${s}$", parsing_timeout=t)


def _norm(s: str) -> str:
    return re.sub(r"\s+|\\[,;!]|\\?\$|\.$", "", s).replace("\\dfrac", "\\frac").lower()


def math_equal(a: str | None, b: str | None) -> bool:
    """Whether two extracted math answers are equivalent (math_verify ``verify`` on both parses,
    then a whitespace/``$``-insensitive string comparison). None equals nothing."""
    if a is None or b is None:
        return False
    if _norm(a) == _norm(b):
        return True
    import math_verify
    pa, pb = _parse(a), _parse(b)
    if not pa or not pb:
        return False
    with _quiet_timeout() as t:
        return bool(math_verify.verify(pa, pb, timeout_seconds=t))


def extract_choice(text: str | None, labels: str = "ABCDE") -> str | None:
    """The chosen letter of a multiple-choice answer (upper case), or None.

    >>> extract_choice("Revolving doors are common in banks. The answer is (A).")
    'A'
    """
    if not text:
        return None
    L = re.escape(labels) + re.escape(labels.lower())
    boxed = last_boxed(text)
    if boxed:
        m = re.fullmatch(rf"\(?\s*(?:\\text\{{)?([{L}])\}}?\s*\)?", boxed.strip())
        if m:
            return m.group(1).upper()
    pats = [rf"(?:answer(?:\s+is)?|option|choice)\s*[:=]?\s*\(?([{L}])\)?(?![A-Za-z])",
            rf"\(([{L}])\)"]
    for p in pats:
        hits = re.findall(p, text, flags=re.I)
        hits = [h for h in hits if h.upper() in labels]
        if hits:
            return hits[-1].upper()
    m = re.fullmatch(rf"\s*\(?([{L}])\s*[.):]?\s*", text)
    return m.group(1).upper() if m else None


def extract_answer(text: str | None, kind: str = MATH) -> str | None:
    """`extract_math_answer` (``kind="math"``) or `extract_choice` (``kind="choice"``).

    Raises:
        ValueError: unknown ``kind``.
    """
    _check_kind(kind)
    return extract_math_answer(text) if kind == MATH else extract_choice(text)


def answers_equal(a: str | None, b: str | None, kind: str = MATH) -> bool:
    """Equality of two *extracted* answers (None equals nothing)."""
    _check_kind(kind)
    if kind == CHOICE:
        return a is not None and b is not None and a.strip().upper() == b.strip().upper()
    return math_equal(a, b)


def is_correct(output: str | None, reference: str, kind: str = MATH) -> bool:
    """Whether a model output's final answer matches the reference answer (the dataset's gold
    answer string, e.g. ``"18"``, ``"\\frac{14}{3}"`` or ``"B"``)."""
    gold = reference.strip() if kind == MATH else extract_choice(reference) or reference.strip()
    return answers_equal(extract_answer(output, kind), gold, kind)


def answers_agree(a: str | None, b: str | None, kind: str = MATH) -> bool:
    """Whether two extracted answers agree: equivalent, or both None (no answer in either)."""
    if a is None and b is None:
        return True
    return answers_equal(a, b, kind)
