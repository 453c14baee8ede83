"""The matched random references of a sweep: which ones stand beside the swept points, and
whether each realised what it was matched to.

For every swept point with a large fraction f strictly between 0 and 1:
- ``random``: `RandomRouting` (p = f): one-token large visits, so its hop rate is about 2f;
- ``random_span``: `RandomSpanRouting` with the point's own mean visit lengths on each model
  (tokens per visit, the visits counted at the point's handoffs, `stats.mean_visits`): matched
  on the large fraction *and* the visit lengths, hence on the hop rate, which is what costs
  time;
- ``random_query``: `RandomQueryRouting` (p = f): the share of questions answered by the large
  model.
Points that would get the same reference (the same rounded parameters) share one.

A matched reference realises its target only up to its own sampling noise; the central 95%
range of what it draws is: exact binomial over committed tokens (``random``) or questions
(``random_query``), and for ``random_span`` the normal range of a two-state Markov chain's
occupation share for the fraction (`stats.chain_fraction_sd`, `stats.span_chain`) and binomial
ranges of the exits for the visit lengths (`stats.mean_range`). A reference outside its range no longer stands for
the point beside it: its record says so and a note names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .config import binomial_range
from .stats import Z95, chain_fraction_sd, mean_range, mean_visits, span_chain, visit_counts

KINDS = ("random", "random_span", "random_query")


@dataclass
class RefPoint:
    """A matched reference to run: its label, kind, policy, swept parameter and value, the swept
    point it stands beside and its targets."""

    label: str
    kind: str
    policy: Any
    param: str
    value: float
    matched_to: str
    target: dict


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd) if math.isfinite(x) else x


def span_label(large_visit: float, small_visit: float) -> str:
    return f"RandomSpanRouting(large_visit={large_visit:g},small_visit={small_visit:g})"


def matched_references(swept: list[dict], refs, seed: int = 0) -> tuple[list[RefPoint], list[dict]]:
    """``(references to run, skipped)`` for the swept point records ``swept`` (in run order;
    ``refs``: the reference kinds asked for). A point with no large fraction strictly between 0
    and 1 (all answered by one model, or no request answered) gets none; ``skipped`` says which
    and why."""
    from ..policies import RandomQueryRouting, RandomRouting, RandomSpanRouting

    out: dict[str, RefPoint] = {}
    skipped = []
    want = [k for k in KINDS if k in refs]
    if not want:
        return [], []
    for rec in swept:
        f = rec.get("large_fraction")
        if rec.get("answered", 1) == 0 or f is None or not 0.0 < round(float(f), 3) < 1.0:
            why = (
                f"none of its {rec.get('n', '?')} requests was answered"
                if rec.get("answered", 1) == 0
                else f"its large fraction {f if f is None else round(float(f), 3)} is not strictly between 0 and 1"
            )
            skipped.append({"point": rec["label"], "references": want, "why": why})
            continue
        f = round(float(f), 3)
        if "random" in want:
            label = f"RandomRouting(p={f:g})"
            out.setdefault(
                label,
                RefPoint(label, "random", RandomRouting(p=f, seed=seed), "p", f, rec["label"], {"large_fraction": f}),
            )
        if "random_span" in want:
            lv, sv = rec.get("mean_large_visit"), rec.get("mean_small_visit")
            lv = math.inf if lv is None else _r(max(1.0, lv), 2)
            sv = math.inf if sv is None else _r(max(0.0, sv), 2)
            if math.isinf(sv):
                skipped.append(
                    {
                        "point": rec["label"],
                        "references": ["random_span"],
                        "why": "no small-model visit of it ended in a hand-off (no visit length to match)",
                    }
                )
            else:
                label = span_label(lv, sv)
                out.setdefault(
                    label,
                    RefPoint(
                        label,
                        "random_span",
                        RandomSpanRouting(large_visit=lv, small_visit=sv, seed=seed),
                        "large_visit",
                        lv,
                        rec["label"],
                        {"large_fraction": f, "mean_large_visit": lv, "mean_small_visit": sv},
                    ),
                )
        if "random_query" in want:
            label = f"RandomQueryRouting(p={f:g})"
            out.setdefault(
                label,
                RefPoint(
                    label,
                    "random_query",
                    RandomQueryRouting(p=f, seed=seed),
                    "p",
                    f,
                    rec["label"],
                    {"large_fraction": f},
                ),
            )
    return list(out.values()), skipped


def check_reference(rec: dict, answers: list[dict], large: str) -> str | None:
    """Record in ``rec`` whether the matched reference realised its target (``target``,
    ``realised``, ``target_range``, ``matches_target``; for ``random_span`` also the visit
    lengths' targets, realised values and ranges); returns a warning text when it did not."""
    ok = [a for a in answers if a.get("ok", a.get("error") is None)]
    kind = rec["kind"]
    tgt = rec.get("targets") or {"large_fraction": rec["value"]}
    target = tgt["large_fraction"]
    if kind == "random_query":
        n = len(ok)
        share = sum(a["tokens"] > 0 and a["large_tokens"] == a["tokens"] for a in ok) / n if n else 0.0
        lo, hi = binomial_range(n, target)
        what, unit = "a share of questions answered by the large model of", "questions"
    elif kind == "random_span":
        vis = mean_visits([visit_counts(a.get("visits") or [], large) for a in ok])
        n = vis["tokens_large"] + vis["tokens_small"]
        share = vis["tokens_large"] / n if n else 0.0
        lv, sv = tgt["mean_large_visit"], tgt["mean_small_visit"]
        sd = chain_fraction_sd(*span_chain(lv, sv), n)
        lo, hi = max(0.0, target - Z95 * sd), min(1.0, target + Z95 * sd)
        what, unit = "a large fraction of", "committed tokens"
        visits_ok = True
        trials = {"large": vis["at_risk_large"], "small": vis["tokens_small"] + vis["ended_small"]}
        for side, want in (("large", lv), ("small", sv)):
            got = vis[f"mean_{side}_visit"]
            rng = mean_range(trials[side], want, binomial_range, zero=side == "small")
            inside = rng is None or (got is not None and rng[0] <= got <= rng[1])
            rec[f"realised_{side}_visit"], rec[f"{side}_visit_range"] = got, list(rng) if rng else None
            visits_ok &= inside
        rec["visits_match"] = visits_ok
    else:
        n = sum(a["tokens"] for a in ok)
        share = sum(a["large_tokens"] for a in ok) / n if n else 0.0
        lo, hi = binomial_range(n, target)
        what, unit = "a large fraction of", "committed tokens"
    inside = lo <= share <= hi
    matches = inside and rec.get("visits_match", True)
    rec.update(target=target, realised=share, target_range=[lo, hi], matches_target=matches)
    if matches:
        return None
    if not inside:
        return (
            f"reference {rec['label']} realised {what} {share:.3g} on {n} {unit}, outside the 95% sampling range "
            f"[{lo:.3g}, {hi:.3g}] of its target {target:g} (the large fraction of {rec['matched_to']}): it no "
            f"longer matches that point; use more questions (limit=) to compare at this fraction"
        )
    return (
        f"reference {rec['label']} realised mean visits of {rec['realised_large_visit']} (large) and "
        f"{rec['realised_small_visit']} (small) tokens, outside the 95% ranges {rec['large_visit_range']} and "
        f"{rec['small_visit_range']} of the targets of {rec['matched_to']}: it no longer matches that point's "
        f"visit lengths; use more questions (limit=)"
    )
