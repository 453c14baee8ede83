"""A policy's threshold for a wanted large share: `calibrate_large_share`.

RouteLLM (arXiv 2406.18665, section 5; its ``calibrate_threshold``) sets a router's threshold
from the share of calls a user wants to go to the strong model, measured on held-out queries,
instead of asking for a threshold that means nothing across routers or model pairs. The same
threshold routes very different shares on different pairs (R-Stitch's tau 0.3 sends about a
third of the tokens to the large model on one pair and almost none on another), so here a
policy with one threshold argument is calibrated on calibration prompts: the policy runs
(greedy by default) at the two bounds of the search, then at thresholds chosen by bisection
over the bracket of the target (the linear interpolation of the two closest runs on either side
when it falls in the middle half of the bracket, the midpoint otherwise), until a run realises
the target within ``tol`` or the runs are spent. The large share is the share of committed
tokens the largest model wrote (``large_fraction``, docs/metrics.md), measured on the answered
requests of each run. A routed run changes what the small model writes and so the scores a
token-level policy sees: the share is measured, not predicted from scores.

`search_threshold` is the loop both this and `tokenrouter_sdk.train.package.calibrate_defer`
(score quantiles of a trained head) run; `next_threshold` the interpolation they share.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

MAX_EXPANSIONS = 3  # times the search widens its upper bound (x4 the width) to reach the target
FEW_PROMPTS = 16  # fewer calibration prompts: a warning (the share on other questions may be far off)


class CalibrationError(ValueError):
    """No threshold in reach realises the target large share (the message names the shares the
    runs realised and the fix)."""


@dataclass
class Calibration:
    """A calibrated threshold.

    Attributes:
        param: the policy argument calibrated (e.g. ``"tau"``).
        threshold: its value: the run closest to ``target``.
        target: the large share asked for.
        large_fraction: the share that run realised on the calibration prompts.
        within_tol: ``abs(large_fraction - target) <= tol``.
        tol: the tolerance asked for.
        n_prompts: calibration prompts per run.
        ids: their question ids, when known.
        rounds: one dict per run in order: ``threshold``, ``large_fraction``, ``tokens``
            (committed tokens of answered requests), ``hop_rate``, ``failed``.
    """

    param: str
    threshold: float
    target: float
    large_fraction: float
    within_tol: bool
    tol: float
    n_prompts: int
    ids: list = field(default_factory=list)
    rounds: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def next_threshold(hist: list[dict], target: float) -> float | None:
    """The threshold interpolated linearly between the two runs closest to ``target`` on either
    side of it (``hist``: ``{"threshold", "large_fraction"}`` per run), or None while no two runs
    bracket the target."""
    lo = [h for h in hist if h["large_fraction"] < target]
    hi = [h for h in hist if h["large_fraction"] > target]
    if not lo or not hi:
        return None
    a, b = max(lo, key=lambda h: h["large_fraction"]), min(hi, key=lambda h: h["large_fraction"])
    w = (target - a["large_fraction"]) / (b["large_fraction"] - a["large_fraction"])
    return a["threshold"] + w * (b["threshold"] - a["threshold"])


def search_threshold(
    run: Callable[[float], dict],
    target: float,
    first: Sequence[float],
    propose: Callable[[list[dict]], float | None],
    *,
    rounds: int,
    tol: float,
) -> tuple[float, list[dict]]:
    """Run thresholds until one realises ``target`` within ``tol``: ``first`` in order, then
    ``propose(runs so far)`` (None stops), at most ``rounds`` runs.

    Args:
        run: ``run(threshold)`` -> a dict with at least ``large_fraction`` (the threshold is
            added as ``threshold``).

    Returns:
        ``(threshold of the run closest to target, the runs in order)``.
    """
    hist: list[dict] = []
    queue = [float(v) for v in first]
    for _ in range(rounds):
        value = queue.pop(0) if queue else propose(hist)
        if value is None:
            break
        rec = dict(run(float(value)), threshold=float(value))
        hist.append(rec)
        if abs(rec["large_fraction"] - target) <= tol:
            break
    best = min(hist, key=lambda h: abs(h["large_fraction"] - target))
    return best["threshold"], hist


def measure_share(
    router,
    policy,
    prompts: list,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = 0,
    concurrency: int | None = 16,
) -> dict:
    """One run of ``policy`` on ``prompts``: ``large_fraction`` (committed tokens of answered
    requests written by the last model / all of them), ``tokens``, ``hop_rate``, ``failed``.

    Raises:
        RuntimeError: every request failed (names the first error)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # failed requests are counted here
        outs = router.generate(
            prompts,
            policy=policy,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            concurrency=concurrency,
        )
    ok = [o for o in outs if o.ok]
    if not ok:
        raise RuntimeError(f"calibration run of {policy!r} failed: every request failed; first error: {outs[0].error}")
    large = list(router.models)[-1]
    tokens = sum(len(o.token_ids) for o in ok)
    return {
        "large_fraction": sum(o.token_models.count(large) for o in ok) / tokens if tokens else 0.0,
        "tokens": tokens,
        "hop_rate": sum(o.hops for o in ok) / tokens if tokens else 0.0,
        "failed": len(outs) - len(ok),
    }


def _bisect(target: float, lo: float, hi: float, param: str, tol: float) -> Callable[[list[dict]], float | None]:
    """The ``propose`` of the bisection: once the runs at ``lo`` and ``hi`` are in, the next
    threshold inside the bracket of the target; the upper bound widened (x4, at most
    `MAX_EXPANSIONS` times) while the target lies beyond it.

    Raises (from the returned function):
        CalibrationError: the threshold changes nothing between the bounds, or the target lies beyond
            the lower bound, or beyond the widened upper one."""
    state = {"hi": hi, "grown": 0}

    def propose(hist: list[dict]) -> float | None:
        at = {h["threshold"]: h["large_fraction"] for h in hist}
        s_lo, s_hi = at[lo], at[state["hi"]]
        runs = sorted(at.items())
        # the innermost bracket: neighbouring thresholds whose shares lie on either side of the target
        pairs = [(a, b) for a, b in zip(runs, runs[1:]) if (a[1] - target) * (b[1] - target) < 0]
        if pairs:
            (a, fa), (b, fb) = min(pairs, key=lambda ab: ab[1][0] - ab[0][0])
            x = a + (target - fa) / (fb - fa) * (b - a)  # linear interpolation of the share
            return x if a + 0.25 * (b - a) <= x <= b - 0.25 * (b - a) else (a + b) / 2
        if s_lo == s_hi and not state["grown"]:
            raise CalibrationError(
                f"{param}={lo:g} and {param}={state['hi']:g} both realise a large share of {s_lo:.3f}: "
                f"the threshold changes nothing there; give bounds (values) where it does"
            )
        increasing = s_hi > s_lo
        beyond_hi = target > s_hi if increasing else target < s_hi
        if beyond_hi and state["grown"] < MAX_EXPANSIONS:
            state["grown"] += 1
            state["hi"] = lo + 4 * (state["hi"] - lo)
            return state["hi"]
        shares = sorted(at.values())
        raise CalibrationError(
            f"no {param} in [{lo:g}, {state['hi']:g}] realises a large share of {target:g} (the runs "
            f"realised {shares[0]:.3f} to {shares[-1]:.3f}): give bounds (values) that reach it"
        )

    return propose


def calibrate_large_share(
    router,
    policy_factory,
    prompts: list,
    target: float,
    *,
    param: str | None = None,
    bounds: tuple[float, float] = (0.0, 1.0),
    rounds: int = 8,
    tol: float = 0.02,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int | None = 0,
    concurrency: int | None = 16,
    ids: Sequence[str] | None = None,
) -> Calibration:
    """The threshold at which a policy with one threshold realises a large share of about
    ``target`` on ``prompts`` (the module docstring says how).

    Args:
        router: a `Router` (sub-servers in threads or processes).
        policy_factory: value -> `Policy` (a callable, e.g. ``lambda t: RStitch(tau=t)``) or a
            Policy class (called with ``param=value``). `evaluate_policy` also takes the built-in
            names (``"rstitch"``, ...).
        prompts: calibration prompts (text or token ids), held out from any evaluation.
        target: the wanted share of committed tokens written by the largest model, in (0, 1).
        param: the threshold's argument name (for the class form and the record).
        bounds: ``(lo, hi)`` where the search starts; the upper bound widens (x4, at most 3
            times) when the target lies beyond it.
        rounds: runs at most (the two bounds included); tol: stop when a run is within it.
        max_new_tokens, temperature, seed, concurrency: each run's sampling (default greedy).
        ids: the prompts' question ids (kept in the record).

    Returns:
        a `Calibration`.

    Raises:
        ValueError: ``target`` outside (0, 1), ``bounds`` not lo < hi, ``rounds < 2``, no
            prompts.
        TypeError: ``policy_factory`` is neither callable nor a class with ``param``.
        CalibrationError: the threshold changes nothing between the bounds, or no threshold in
            reach realises the target (names the shares realised).
        RuntimeError: a calibration run failed every request.
    """
    if not (isinstance(target, numbers.Real) and 0 < target < 1):
        raise ValueError(f"target_large_share must be in (0, 1) (a share of committed tokens), got {target!r}")
    lo, hi = (float(b) for b in bounds)
    if not lo < hi:
        raise ValueError(f"bounds must be (lo, hi) with lo < hi, got {bounds!r}")
    if not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"rounds must be an int >= 2 (the two bounds are run first), got {rounds!r}")
    if not prompts:
        raise ValueError("calibrate_large_share: no calibration prompts")
    if len(prompts) < FEW_PROMPTS:
        import warnings

        warnings.warn(
            f"calibrating on {len(prompts)} prompt(s), fewer than {FEW_PROMPTS}: the large share the "
            f"threshold realises on other questions may be far from the target {target:g}; calibrate on "
            f"more (calibration=N, --calibration N)",
            UserWarning,
            stacklevel=2,
        )
    if isinstance(policy_factory, type):
        if not param:
            raise TypeError(
                f"calibrate_large_share: a Policy class needs param= (the threshold argument of "
                f"{policy_factory.__name__}), or give a callable value -> Policy"
            )
        cls = policy_factory
        factory, pname = (lambda v: cls(**{param: v})), param
    elif callable(policy_factory):
        factory, pname = policy_factory, param or "value"
    else:
        raise TypeError(
            f"calibrate_large_share: policy_factory must be a callable value -> Policy or a Policy "
            f"class, got {type(policy_factory).__name__}"
        )

    def run(v: float) -> dict:
        return measure_share(
            router,
            factory(v),
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            concurrency=concurrency,
        )

    value, hist = search_threshold(
        run, float(target), [lo, hi], _bisect(float(target), lo, hi, pname, tol), rounds=rounds, tol=tol
    )
    got = next(h["large_fraction"] for h in hist if h["threshold"] == value)
    return Calibration(
        pname, value, float(target), got, abs(got - target) <= tol, tol, len(prompts), list(ids or []), hist
    )


# -- inside a sweep (`evaluate_policy(..., target_large_share=...)`) -------------------------------
CALIBRATION_QUESTIONS = 32  # held-out questions a sweep calibrates on by default


def check_targets(target_large_share) -> list[float]:
    """``target_large_share`` (None, a share or a list of shares) as a list of floats in (0, 1).

    Raises:
        ValueError: a share outside (0, 1), or an empty list."""
    if target_large_share is None:
        return []
    shares = list(target_large_share) if isinstance(target_large_share, (list, tuple)) else [target_large_share]
    if not shares:
        raise ValueError("target_large_share is empty: give a share in (0, 1), e.g. 0.3, or a list of them")
    for t in shares:
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 < t < 1:
            raise ValueError(
                f"target_large_share must be in (0, 1) (a share of committed tokens written by the "
                f"large model), got {t!r}"
            )
    return [float(t) for t in shares]


def _calibration_prompts(calibration, bench, dataset, drop: set, seed) -> tuple[list, list]:
    """(prompts, ids) of the held-out calibration questions (see `evaluate_policy`'s
    ``calibration``).

    Raises:
        ValueError: a count below 1, a benchmark given as loaded (its held-out questions cannot
            be drawn: give ``calibration`` as a Benchmark or prompts), or no question left."""
    from .datasets import Benchmark, load_benchmark

    if calibration is None:
        calibration = CALIBRATION_QUESTIONS
    if isinstance(calibration, Benchmark):
        return list(calibration.prompts), list(calibration.ids)
    if isinstance(calibration, (list, tuple)):
        if not calibration:
            raise ValueError("calibration is an empty list of prompts")
        return list(calibration), [f"prompt-{k:04d}" for k in range(len(calibration))]
    if isinstance(calibration, bool) or not isinstance(calibration, int) or calibration < 1:
        raise ValueError(
            f"calibration must be a number of held-out questions (>= 1), a Benchmark or a list of "
            f"prompts, got {calibration!r}"
        )
    if isinstance(dataset, Benchmark):
        raise ValueError(
            "with a loaded Benchmark as dataset, give calibration as a Benchmark or a list of prompts "
            "held out from it (the held-out questions cannot be drawn from it)"
        )
    cal = load_benchmark(dataset, limit=calibration, seed=seed, exclude=set(drop) | set(bench.ids))
    return list(cal.prompts), list(cal.ids)


def calibrate_entries(
    router,
    entries: list,
    targets: list[float],
    bench,
    dataset,
    calibration,
    drop: set,
    seed,
    sampling: dict,
    concurrency,
    who: str,
) -> tuple[dict, dict]:
    """Calibrate every swept policy of a sweep for each target on the held-out questions; each
    entry's values become the thresholds found (one point per target).

    Returns:
        ``({(entry index, point index): record keys of that point}, the sweep config's
        ``calibration``)``.

    Raises:
        ValueError: as `calibrate_large_share`."""
    import warnings

    prompts, ids = _calibration_prompts(calibration, bench, dataset, drop, seed)
    per_point, out = {}, {}
    for i, e in enumerate(entries):
        nums = [v for v in e.values if isinstance(v, numbers.Real) and not isinstance(v, bool)]
        bounds = (min([0.0, *nums]), max([1.0, *nums]))
        thresholds = []
        for j, t in enumerate(targets):
            cal = calibrate_large_share(
                router,
                e.factory,
                prompts,
                t,
                param=e.param,
                bounds=bounds,
                max_new_tokens=sampling["max_new_tokens"],
                temperature=sampling["temperature"],
                seed=sampling["seed"],
                concurrency=concurrency,
                ids=ids,
            )
            if not cal.within_tol:
                warnings.warn(
                    f"{who}: {e.name or e.param}: the closest calibration run for a large share of {t:g} "
                    f"realised {cal.large_fraction:.3f} ({e.param}={cal.threshold:g}, {len(cal.rounds)} "
                    f"runs on {len(prompts)} questions); evaluated at that threshold",
                    UserWarning,
                    stacklevel=4,
                )
            thresholds.append(cal.threshold)
            rec = cal.to_dict()
            rec.pop("ids")
            per_point[(i, j)] = {"target_large_share": t, "calibration": rec}
        e.values = thresholds
        e.first = e.factory(thresholds[0])
        out[e.name or str(i)] = {
            "param": e.param,
            "bounds": list(bounds),
            "targets": {f"{t:g}": per_point[(i, j)]["calibration"]["threshold"] for j, t in enumerate(targets)},
        }
    return per_point, {
        "targets": targets,
        "n_questions": len(prompts),
        "ids": ids,
        "policies": out,
        "rule": "bisection of each policy's threshold on the held-out questions until a run realises "
        "the target large share within its tol (calibrate_large_share)",
    }
