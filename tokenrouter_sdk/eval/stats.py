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
_COUNTS = (
    "tokens_large",
    "tokens_small",
    "visits_large",
    "visits_small",
    "ended_large",
    "ended_small",
    "at_risk_large",
)


def visits_from_trace(trace, rids) -> dict[int, list[list]]:
    """Per request of ``rids``, its visits in order as ``[model, committed tokens]`` (a visit
    starts at admission on the entry model and at every handoff; a visit after which the request
    was handed on without a commit has 0 tokens), from a call's events (`Admitted`, `Committed`,
    `Hopped`)."""
    from ..engine.messages import Admitted, Committed, Hopped

    rids = set(rids)
    evs = [e for e in trace if isinstance(e, (Admitted, Committed, Hopped)) and e.rid in rids]
    evs.sort(key=lambda e: e.t)  # one host clock (sub-servers' events are put on the engine's)
    out: dict[int, list[list]] = {}
    for e in evs:
        cur = out.setdefault(e.rid, [])
        if isinstance(e, Admitted):
            if not cur:
                cur.append([e.model, 0])
        elif isinstance(e, Hopped):
            cur.append([e.dst, 0])
        elif e.tokens:
            if not cur or cur[-1][0] != e.model:
                cur.append([e.model, 0])
            cur[-1][1] += len(e.tokens)
    return out


def visit_counts(visits, large: str) -> dict:
    """Tokens and visits of one answer (its ``[model, tokens]`` visits in order) by the large
    model and by the others: ``tokens_*``, ``visits_*``, ``ended_*`` (visits a hand-off ended:
    all but the answer's last) and ``at_risk_large`` (large tokens after which a hand-off could
    be seen: all but the answer's last token when it ended on the large model)."""
    out = dict.fromkeys(_COUNTS, 0)
    for i, (model, n) in enumerate(visits):
        side = "large" if model == large else "small"
        out[f"tokens_{side}"] += n
        out[f"visits_{side}"] += 1
        out[f"ended_{side}"] += i < len(visits) - 1
    last = visits[-1] if visits else None
    out["at_risk_large"] = out["tokens_large"] - bool(last and last[0] == large and last[1] > 0)
    return out


def mean_visits(per_answer: Sequence[dict]) -> dict:
    """Summed `visit_counts` of several answers, plus the mean visit lengths (tokens), the
    maximum-likelihood means of `RandomSpanRouting`'s geometric visits when each answer's last
    visit is cut short by its end: ``mean_large_visit`` = large tokens after which a hand-off
    could be seen / large visits a hand-off ended (spans of at least one token);
    ``mean_small_visit`` = small tokens / small visits a hand-off ended (stretches of zero or
    more tokens: a request handed straight back up counts a visit of 0). None when no visit
    there ended."""
    tot = dict.fromkeys(_COUNTS, 0)
    for c in per_answer:
        for k in tot:
            tot[k] += c[k]
    tot["mean_large_visit"] = tot["at_risk_large"] / tot["ended_large"] if tot["ended_large"] else None
    tot["mean_small_visit"] = tot["tokens_small"] / tot["ended_small"] if tot["ended_small"] else None
    return tot


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
def chain_fraction_sd(p_to_large: float, p_to_small: float, tokens: int) -> float:
    """Standard deviation of the large fraction over ``tokens`` committed tokens of a two-state
    Markov chain over the writers, which moves from a small token to a large one with
    probability ``p_to_large`` and back with ``p_to_small``: sqrt(pi (1 - pi) (1 + l) / ((1 - l) n))
    with pi = a / (a + b) and l = 1 - a - b, the asymptotic variance of a two-state chain's
    occupation share (Kemeny and Snell, Finite Markov Chains, 1960, section 4.6)."""
    a, b = p_to_large, p_to_small
    if tokens <= 0 or a + b <= 0:
        return 0.0
    pi, lam = a / (a + b), 1 - a - b
    if lam >= 1:
        return 0.0
    return math.sqrt(max(0.0, pi * (1 - pi) * (1 + lam) / ((1 - lam) * tokens)))


def span_chain(large_visit: float, small_visit: float) -> tuple[float, float]:
    """``(p_to_large, p_to_small)`` of the writer chain of `RandomSpanRouting`: a small step
    hands off with q = 1 / (1 + small_visit), a large span ends after each token with
    b = 1 / large_visit and the small model's next step may hand off at once, so
    P(small -> large) = q and P(large -> small) = b (1 - q); the large share tends to
    large_visit / (large_visit + small_visit)."""
    q = 0.0 if math.isinf(small_visit) else 1.0 / (1.0 + small_visit)
    b = 0.0 if math.isinf(large_visit) else 1.0 / large_visit
    return q, b * (1 - q)


def mean_range(trials: int, mean: float | None, binomial_range, *, zero: bool) -> tuple[float, float] | None:
    """The central 95% range of a realised mean visit length of geometric visits (`mean_visits`):
    each of ``trials`` trials ends its visit with probability p independently, so the exits are
    binomial; for visits of at least one token (``zero=False``) p = 1 / mean and the mean is
    trials / exits, for stretches of zero or more (``zero=True``: trials are steps, tokens plus
    exits) p = 1 / (1 + mean) and the mean is (trials - exits) / exits. None without a finite
    target or trials."""
    if mean is None or not math.isfinite(mean) or trials <= 0 or mean < (0 if zero else 1):
        return None
    p = 1.0 / (1.0 + mean) if zero else 1.0 / mean
    lo, hi = binomial_range(trials, p)
    to_mean = (lambda s: (1 - s) / s if s > 0 else math.inf) if zero else (lambda s: 1 / s if s > 0 else math.inf)
    return to_mean(hi), to_mean(lo)


# -- paired comparisons ------------------------------------------------------------------------
def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> dict | None:
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
APGR_MAX_BRIDGE = 0.5
"""At most this share of the cost axis (large fraction 0 to 1) may lie outside the range of a
policy's own points for `gain_summary` to report its APGR: beyond it the area would be mostly the
straight lines to the small-only and large-only references, not the policy's curve."""


def gain_summary(points: Sequence[tuple[float, float]], small: float, large: float) -> dict:
    """RouteLLM's summaries of a quality-vs-cost curve (Ong et al., RouteLLM, arXiv 2406.18665,
    section 5.1), with cost = the large fraction: the performance gap recovered PGR(f) =
    (q(f) - q_small) / (q_large - q_small) along the piecewise-linear curve through the policy's
    points ``(large fraction, quality)``, small-only at (0, ``small``) and large-only at (1,
    ``large``) (points at one fraction averaged); ``apgr`` its mean over f in [0, 1] (the area
    under it); ``large_fraction_50`` / ``large_fraction_80`` the least large fraction where the
    curve reaches 50% / 80% of the gain.

    A summary is given only where the policy's own points carry it, else it is None and
    ``why_na[key]`` says why: APGR needs two points at distinct large fractions strictly between
    0 and 1 that span all but `APGR_MAX_BRIDGE` of the axis; a large fraction at a share of the
    gain needs the crossing to fall at or between the policy's points (one found only on the
    straight line to a reference, or before the first point, is not the policy's). Without a gain
    (``large <= small``) every summary is None and ``why`` says so.

    Returns:
        ``{"gain", "apgr", "large_fraction_50", "large_fraction_80", "why", "why_na",
        "span"}``; ``span`` = the policy's (least, greatest) large fraction in (0, 1), or None.
    """
    gain = large - small
    keys = ("apgr", "large_fraction_50", "large_fraction_80")
    out = {
        "gain": gain,
        "apgr": None,
        "large_fraction_50": None,
        "large_fraction_80": None,
        "why": None,
        "why_na": {},
        "span": None,
    }
    if not gain > 0:
        out["why"] = f"large-only ({large:.3g}) is not above small-only ({small:.3g}): there is no gain to recover"
        out["why_na"] = dict.fromkeys(keys, out["why"])
        return out
    by: dict[float, list[float]] = {0.0: [small], 1.0: [large]}
    for f, q in points:
        if f is not None and q is not None and 0.0 < f < 1.0:
            by.setdefault(float(f), []).append(float(q))
    mine = sorted(x for x in by if 0.0 < x < 1.0)
    if not mine:
        out["why"] = "no point of the policy has a large fraction strictly between 0 and 1"
        out["why_na"] = dict.fromkeys(keys, out["why"])
        return out
    lo, hi = mine[0], mine[-1]
    out["span"] = (lo, hi)
    xs = sorted(by)
    ys = [(sum(by[x]) / len(by[x]) - small) / gain for x in xs]
    bridged = lo + (1.0 - hi)
    if len(mine) < 2:
        out["why_na"]["apgr"] = (
            f"one point (large fraction {lo:.3g}): the area would be the straight lines to the "
            f"references; sweep more values"
        )
    elif bridged > APGR_MAX_BRIDGE:
        out["why_na"]["apgr"] = (
            f"the points span large fractions {lo:.3g} to {hi:.3g}: {bridged:.0%} of the axis "
            f"would be the straight lines to the references (at most "
            f"{APGR_MAX_BRIDGE:.0%}); sweep values that reach further"
        )
    else:
        out["apgr"] = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
    for share, key in ((0.5, "large_fraction_50"), (0.8, "large_fraction_80")):
        cross = None
        for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]):
            if y0 >= share:
                cross = x0
                break
            if y1 >= share:
                cross = x0 + (x1 - x0) * (share - y0) / (y1 - y0)
                break
        if cross is not None and lo <= cross <= hi:
            out[key] = cross
        elif cross is not None and cross < lo:
            out["why_na"][key] = (
                f"reached below the policy's least large fraction {lo:.3g}, on the line from "
                f"small-only; sweep values with a smaller large fraction"
            )
        else:
            out["why_na"][key] = (
                f"not reached within the policy's points (large fraction up to {hi:.3g})"
                + (f"; the straight line to large-only would put it at {cross:.3g}" if cross is not None else "")
                + "; sweep values with a larger large fraction"
            )
    return out
