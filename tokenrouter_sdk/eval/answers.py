"""Final-answer extraction and checking for model outputs.

Math sets (GSM8K, MATH-500, AIME, AMC): the answer is, in this order of priority,
1. the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces matched, so nesting such as
   ``\\boxed{\\frac{1}{2}}`` or ``\\boxed{\\boxed{5}}`` works),
2. what follows the last anchor ``####``, ``final answer`` or ``the answer is`` / ``Answer:`` on its
   line: a ``$...$`` span, a LaTeX expression (prose after it such as ``cm`` or ``, which ...``
   cut off), else the first number,
3. the last expression in the text: a LaTeX expression is taken whole (``1 - \\frac{1}{e}``,
   ``2\\sqrt{3}``, ``-\\frac{3}{4}``, ``\\frac{\\pi}{2} + 1``; what follows the last ``=``), plain
   arithmetic gives its last number (``24 - 4 = 20`` -> ``20``, ``-3.5``, ``3/4``).
Thousands separators are removed first (``1,234``, ``9{,}500``, ``9\\,500``, ``9\\!,500``,
``10,\\!080`` -> digits only; a plain comma inside a tuple or interval such as ``(12,102)`` is
kept), as are a leading ``$`` and a trailing period. The extracted strings are compared with
`math_verify` (Hugging Face Math-Verify: ``parse`` then ``verify``; LaTeX, fractions, percentages
and ``\\text{}`` units are normalised there), after a plain string comparison.

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
        found, i = text[m.end() : j - 1].strip(), j
    if found is not None and (m := _BOX.match(found)) and found.endswith("}"):
        sub = last_boxed(found)
        if sub is not None and len(found[m.end() : -1].strip()) == len(sub):
            return sub
    return found


# Thousands separators. LaTeX spellings between a digit and a group of exactly three digits
# (``9{,}500``, ``9\,500``, ``9\!,500``, ``10,\!080``, ``11,\! 111``) are unambiguous and removed
# anywhere; a plain comma (``9,500``) only in a chain of 3-digit groups that is not inside a
# tuple or interval (``(12,102)`` stays as it is).
_LATEX_SEP = re.compile(r"(?<=\d)(?:\{,\}|,\s*\\!\s*|\\!\s*,\s*|\\,)(?=\d{3}(?!\d))")
_PLAIN_THOUSANDS = re.compile(r"(?<![\d.,(\[{])\d{1,3}(?:,\d{3})+(?![\d)\]]|,\d)")
_FULL_NUMBER = re.compile(r"[-+]?(?:\\?\$)?\s*\d{1,3}(?:,\d{3})+(?:\.\d+)?\s*(?:\\?%)?")
_CURRENCY = re.compile(r"^(-?)\s*\\?\$\s*(?=[-\d.])")

# One expression: numbers and LaTeX commands (with their brace arguments, nested up to three
# deep) joined by operators, or side by side for implicit products (``2\sqrt{3}``).
_BR = r"\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}"
_RELATION = (
    r"(?:le|ge|leq|geq|neq|ne|lt|gt|approx|sim|equiv|to|implies|Rightarrow|rightarrow|iff|quad|qquad|"
    r"cdot|times|pm|mp|div|in|cup|cap|boxed|fbox|text|mbox|textbf|mathrm)\b"
)
_CMD = rf"\\(?!{_RELATION})[a-zA-Z]+(?:\s*{_BR})*"
_UNIT = r"\\(?:text|mbox|textbf|mathrm)\s*\{[^{}]*\}"
_ATOM = rf"(?:\d+(?:\.\d+)?|\.\d+|{_CMD})(?:\s*\^\s*(?:{_BR}|\d))?"
_OP = r"\s*(?:[-+*/]|\\cdot|\\times|\\pm|\\mp|\\div)\s*"
_RUN = re.compile(rf"(?<![\w.])-?\s*{_ATOM}(?:{_OP}{_ATOM}|\s*(?=\\){_ATOM})*(?:\s*{_UNIT})*")
_MATH_WORD = re.compile(r"\d|\\(?:pi|infty|sqrt|[dt]?frac|ln|log|sin|cos|tan|e)\b")
_HAS_LATEX = re.compile(r"\\[a-zA-Z]|\^")
_PROSE = re.compile(r"[A-Za-z]{3,}")
# $...$ (not the escaped \$) or \(...\) or \[...\]
_MATH_SPAN = re.compile(r"(?<!\\)\$((?:\\.|[^$\\])+)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")


def strip_thousands(text: str, prose: bool = False) -> str:
    """``text`` with thousands separators removed: the LaTeX spellings always; plain commas in
    prose (``prose=True``: any chain of 3-digit groups outside a tuple or interval) or, for an
    extracted answer, only when the whole answer is one such number (``1,000`` -> ``1000`` but
    ``1,-2`` and ``(12,102)`` unchanged).

    >>> strip_thousands("9{,}500 and 10,\\\\!080")
    '9500 and 10080'
    """
    text = _LATEX_SEP.sub("", text)
    if prose:
        return _PLAIN_THOUSANDS.sub(lambda m: m.group().replace(",", ""), text)
    if _FULL_NUMBER.fullmatch(text.strip()):
        return text.replace(",", "")
    return text


def _top_level_rhs(expr: str) -> str:
    """What follows the last ``=`` outside braces and brackets (``x = 5`` -> ``5``)."""
    depth, cut = 0, -1
    for i, ch in enumerate(expr):
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
        elif ch == "=" and depth == 0:
            cut = i
    return expr[cut + 1 :] if cut >= 0 else expr


def _clean(ans: str) -> str:
    """An extracted answer tidied: a ``\\text{...}`` wrapping all of it unwrapped, thousands
    separators and a leading currency sign removed, outer whitespace and a trailing period
    stripped."""
    ans = ans.strip()
    if m := re.fullmatch(r"\\(?:text|mbox|textbf|mathrm)\s*\{([^{}]*)\}", ans):
        ans = m.group(1).strip()
    ans = strip_thousands(ans).strip()
    ans = _CURRENCY.sub(r"\1", ans)
    return ans.rstrip(".").strip()


def _valid_run(run: str) -> bool:
    body = re.sub(_UNIT, "", run)
    return bool(_MATH_WORD.search(body))


def _run_answer(run: str) -> str:
    """The answer a run gives: the whole run (without trailing ``\\text{...}`` units) when it
    holds LaTeX, else its last number (plain arithmetic: ``24 - 4`` gives ``4``)."""
    run = re.sub(rf"(?:\s*{_UNIT})+$", "", run).strip()
    if _HAS_LATEX.search(run):
        return run
    nums = _NUMBER.findall(run)
    return re.sub(r"\s", "", nums[-1]) if nums else run


def _expression_runs(text: str) -> list[str]:
    return [m.group().strip() for m in _RUN.finditer(text) if _valid_run(m.group())]


def _last_expression(text: str) -> str | None:
    """The last number or LaTeX expression in ``text`` (thousands separators already removed)."""
    runs = _expression_runs(text)
    return _run_answer(runs[-1]) if runs else None


def _from_anchor_tail(tail: str) -> str | None:
    """The answer written right after an anchor such as ``The answer is`` (``tail`` = the rest
    of that line): a ``$...$`` span without prose in it, a LaTeX expression (prose after it cut
    off), or the first number."""
    math = _MATH_SPAN.search(tail)
    if math:
        raw = next(g for g in math.groups() if g is not None)
        # "$18. She also earns $20": two dollar signs around prose, not a math span
        if not _PROSE.search(re.sub(rf"{_UNIT}|\\[a-zA-Z]+", "", raw)):
            inner = _clean(_top_level_rhs(raw))
            if inner:
                return inner
    if _HAS_LATEX.search(tail):
        # cut at the first plain word of two or more letters ("cm", "which"), keep what is before
        head = re.split(r"[,;]?\s+(?=[A-Za-z]{2,}\b)", tail.strip(), maxsplit=1)[0]
        head = _clean(_top_level_rhs(head))
        if head and _MATH_WORD.search(head):
            return head
        runs = _expression_runs(tail)
        if runs:
            return _run_answer(runs[0])
    num = _NUMBER.search(tail)
    return re.sub(r"[,\s]", "", num.group()) if num else None


def extract_math_answer(text: str | None) -> str | None:
    """The final answer of a math solution as a string (see the module docstring for the
    order of rules), or None when the text holds no answer.

    >>> extract_math_answer("3 + 4 = 7 apples, so the answer is 7.")
    '7'
    >>> extract_math_answer("She makes $1,234 per week.")
    '1234'
    >>> extract_math_answer("so it costs $9{,}500.")
    '9500'
    >>> extract_math_answer("The probability is $1 - \\\\frac{1}{e}$.")
    '1 - \\\\frac{1}{e}'
    """
    if not text:
        return None
    boxed = last_boxed(text)
    if boxed:
        return _clean(boxed) or boxed
    text = strip_thousands(text, prose=True)
    anchors = list(_ANCHOR.finditer(text))
    if anchors:
        found = _from_anchor_tail(text[anchors[-1].end() :].strip().split("\n")[0])
        if found:
            return found
    return _last_expression(text)


def _parse(s: str):
    import math_verify

    with _quiet_timeout() as t:
        return math_verify.parse(s if "$" in s or "\\boxed" in s else f"${s}$", parsing_timeout=t)


def _norm(s: str) -> str:
    return re.sub(r"\s+|\\[,;!]|\\?\$|\.$", "", s).replace("\\dfrac", "\\frac").lower()


def math_equal(a: str | None, b: str | None) -> bool:
    """Whether two extracted math answers are equivalent: equal after tidying (thousands
    separators, a leading ``$``, whitespace, ``\\dfrac``), else math_verify ``verify`` on both
    parses. None equals nothing."""
    if a is None or b is None:
        return False
    a, b = _clean(a) or a, _clean(b) or b
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
    pats = [rf"(?:answer(?:\s+is)?|option|choice)\s*[:=]?\s*\(?([{L}])\)?(?![A-Za-z])", rf"\(([{L}])\)"]
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
