"""The statistics of a sweep that compare points on the same questions: writers' visits, token
agreement with large-only, the sampling range of a span-matched random reference, paired
bootstrap intervals and RouteLLM's summaries (APGR, the large fraction for a share of the gain).

All of them take plain lists (per-question values of one point), so they are tested without a
model.
"""

from __future__ import annotations

import math
from typing import Sequence

Z95 = 1.959964  # the two-sided 95% point of the standard normal


# -- visits ------------------------------------------------------------------------------------
_COUNTS = ("tokens_large", "tokens_small", "visits_large", "visits_small", "ended_large", "ended_small",
           "at_risk_large", "at_risk_small")


def visit_counts(writers: Sequence[str], large: str) -> dict:
    """Tokens and visits of one answer by the large model and by the others: ``tokens_large``,
    ``tokens_small``, ``visits_large``, ``visits_small`` (runs of consecutive tokens written by
    the large model, or by any other), ``ended_large``, ``ended_small`` (of those runs, the ones
    a hand-off ended: every run but the answer's last) and ``at_risk_large``, ``at_risk_small``
    (tokens after which a hand-off could be seen: all but the answer's last token)."""
    out = dict.fromkeys(_COUNTS, 0)
    prev = None
    for w in writers:
        side = "large" if w == large else "small"
        out[f"tokens_{side}"] += 1
        if side != prev:
            out[f"visits_{side}"] += 1
            if prev is not None:
                out[f"ended_{prev}"] += 1
            prev = side
    for side in ("large", "small"):
        out[f"at_risk_{side}"] = out[f"tokens_{side}"] - (prev == side)
    return out


def mean_visits(per_answer: Sequence[dict]) -> dict:
    """Summed `visit_counts` of several answers, plus ``mean_large_visit`` and ``mean_small_visit``:
    tokens after which a hand-off could be seen on the side / visits to it that a hand-off ended
    (the maximum-likelihood mean of geometric visit lengths when each answer's last visit is
    cut short by its end); None when no visit there ended (e.g. answers the large model
    finished once it had them)."""
    tot = dict.fromkeys(_COUNTS, 0)
    for c in per_answer:
        for k in tot:
            tot[k] += c[k]
    for side in ("large", "small"):
        tot[f"mean_{side}_visit"] = tot[f"at_risk_{side}"] / tot[f"ended_{side}"] if tot[f"ended_{side}"] else None
    return tot


def writers_of(answer: dict) -> list[str]:
    """The model that wrote each committed token of a recorded answer (from its ``segments``,
    ``[model, tokens]`` runs)."""
    return [m for m, n in answer.get("segments") or () for _ in range(n)]


# -- token agreement ---------------------------------------------------------------------------
def token_agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> tuple[float, float] | None:
    """``(prefix, overall)`` agreement of token outputs with the reference outputs (large-only's),
    question by question: ``prefix`` = positions before the first divergence / positions;
    ``overall`` = positions holding the same token / positions; positions = the longer output's
    length per question (a position past one output's end differs), summed over questions.
    None without positions."""
    pos = same_prefix = same = 0
    for out, ref in zip(outputs, reference):
        n = max(len(out), len(ref))
        eq = [a == b for a, b in zip(out, ref)]
        first = eq.index(False) if False in eq else len(eq)
        pos, same_prefix, same = pos + n, same_prefix + first, same + sum(eq)
    return (same_prefix / pos, same / pos) if pos else None


# -- the span-matched reference ------------------------------------------------------------------
def chain_fraction_sd(p_exit_small: float, p_exit_large: float, tokens: int) -> float:
    """Standard deviation of the large fraction over ``tokens`` committed tokens of a two-state
    Markov chain that leaves the small side with probability ``p_exit_small`` per token and the
    large side with ``p_exit_large`` (`RandomSpanRouting`): sqrt(pi (1 - pi) (1 + l) / ((1 - l) n))
    with pi = a / (a + b) and l = 1 - a - b, the asymptotic variance of a two-state chain's
    occupation share (e.g. Kemeny and Snell, Finite Markov Chains, 1960, section 4.6)."""
    a, b = p_exit_small, p_exit_large
    if tokens <= 0 or a + b <= 0:
        return 0.0
    pi, lam = a / (a + b), 1 - a - b
    if lam >= 1:
        return 0.0
    return math.sqrt(max(0.0, pi * (1 - pi) * (1 + lam) / ((1 - lam) * tokens)))


def mean_range(tokens: int, mean: float | None, binomial_range) -> tuple[float, float] | None:
    """The central 95% range of a realised mean visit length (tokens per ended visit) when each of
    ``tokens`` tokens ends its visit with probability 1 / ``mean`` independently (geometric
    visits): the exits are binomial, so the range is 1 / the exit share's range. None without a
    target mean or tokens."""
    if mean is None or not math.isfinite(mean) or mean < 1 or tokens <= 0:
        return None
    lo, hi = binomial_range(tokens, 1.0 / mean)
    return (1.0 / hi if hi > 0 else math.inf), (1.0 / lo if lo > 0 else math.inf)


# -- paired comparisons ------------------------------------------------------------------------
def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, resamples: int = 2000, seed: int = 0,
                     level: float = 0.95) -> dict | None:
    """Difference of means of paired per-question values (``a[i]`` and ``b[i]`` on question i),
    with a percentile bootstrap interval over the questions (Efron and Tibshirani, An
    Introduction to the Bootstrap, 1993, chapter 13): ``{"n", "diff", "ci_low", "ci_high"}``;
    None without questions. Seeded: the same inputs give the same interval."""
    import numpy as np
    n = len(a)
    if n == 0 or len(b) != n:
        return None
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return {"n": n, "diff": float(d.mean()), "ci_low": float(lo), "ci_high": float(hi)}


# -- RouteLLM summaries --------------------------------------------------------------------------
def gain_summary(points: Sequence[tuple[float, float]], small: float, large: float) -> dict:
    """RouteLLM's summaries of a quality-vs-cost curve (Ong et al., RouteLLM, arXiv 2406.18665,
    section 5.1), with cost = the large fraction: the performance gap recovered PGR(f) =
    (q(f) - q_small) / (q_large - q_small) along the piecewise-linear curve through the points
    ``(large fraction, quality)``, small-only at (0, ``small``) and large-only at (1, ``large``)
    (points at one fraction averaged); ``apgr`` its mean over f in [0, 1] (the area under it);
    ``large_fraction_50`` / ``large_fraction_80`` the least large fraction where the curve reaches
    50% / 80% of the gain (None if it never does). Without a gain (``large <= small``) every
    summary is None and ``why`` says so."""
    gain = large - small
    out = {"gain": gain, "apgr": None, "large_fraction_50": None, "large_fraction_80": None, "why": None}
    if not gain > 0:
        out["why"] = f"large-only ({large:.3g}) is not above small-only ({small:.3g}): there is no gain to recover"
        return out
    by: dict[float, list[float]] = {0.0: [small], 1.0: [large]}
    for f, q in points:
        if f is not None and q is not None and 0.0 < f < 1.0:
            by.setdefault(float(f), []).append(float(q))
    xs = sorted(by)
    ys = [(sum(by[x]) / len(by[x]) - small) / gain for x in xs]
    out["apgr"] = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
    for share, key in ((0.5, "large_fraction_50"), (0.8, "large_fraction_80")):
        for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
            if y0 >= share:
                out[key] = x0
                break
            if y1 >= share:
                out[key] = x0 + (x1 - x0) * (share - y0) / (y1 - y0)
                break
    return out
