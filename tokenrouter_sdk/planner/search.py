"""The threshold search: feasible threshold vectors and the best one under the DTMC."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from ..backends.sim_runner import LatencyModel
from .dtmc import DTMCResult, dtmc_throughput
from .estimate import _trace, estimate_extra_tokens, estimate_keep, estimate_routing


@dataclass
class Plan:
    """The planner's answer.

    Attributes:
        thresholds: the best feasible B_i found.
        predicted_tok_s: its DTMC throughput (committed tokens per second).
        table: every candidate evaluated, best first: ``{"thresholds", "tok_s", "busy",
            "mean_batch", "states"}``.
        n: concurrency planned for; candidates: feasible threshold vectors; search: how they
            were searched (``"exhaustive"`` or ``"pruned"``).
        best: the `DTMCResult` of the pick.
    """

    thresholds: dict[str, int]
    predicted_tok_s: float
    table: list[dict] = field(default_factory=list)
    n: int = 0
    candidates: int = 0
    search: str = "exhaustive"
    best: DTMCResult | None = None


def feasible_thresholds(models: Sequence[str], n: int) -> list[dict[str, int]]:
    """Every threshold vector with B_i >= 1 and sum_i (B_i - 1) < n (with a larger
    sum, the N requests can sit B_i - 1 at each model i, every model waits under its threshold and
    none ever steps)."""
    models = list(models)
    out = []
    for slack in itertools.product(range(n), repeat=len(models)):
        if sum(slack) < n:
            out.append({m: s + 1 for m, s in zip(models, slack)})
    return out


def plan_thresholds(
    latency: dict[str, LatencyModel],
    routing: dict[str, float],
    n: int,
    *,
    keep: dict[str, float] | None = None,
    extra_tokens: dict[str, float] | None = None,
    search: str = "auto",
    max_exhaustive: int = 160,
    search_ticks: float = 2,
    ticks: float = 4,
    refine: int = 5,
    progress=None,
    **dtmc_kw,
) -> Plan:
    """Best feasible delayed-batching thresholds for concurrency ``n`` by the DTMC.

    Candidates are ranked with a coarse tick (``search_ticks`` ticks for the shortest step: the
    throughput moves by < 1% against finer ticks, at half the states); the best ``refine`` are then
    solved again with ``ticks`` and the pick is the best of those.

    Args:
        latency, routing, keep, extra_tokens: as in `dtmc_throughput` (two models, entry first).
        n: concurrency N.
        search: ``"exhaustive"`` (every feasible vector: N (N + 1) / 2 of them), ``"pruned"`` (a
            grid of B values in powers of two, then a pattern search from the three best: moves of
            +-s along each threshold and trading one for the other, s halving from N/4 to 1 when
            no move improves), or ``"auto"`` (exhaustive up to ``max_exhaustive`` candidates).
        search_ticks, ticks, refine: tick resolution of the search and of the final ranking.
        progress: optional callable ``progress(evaluated, total or None)``.
        **dtmc_kw: passed to `dtmc_throughput` (rounding, max_states, max_batch; a fixed ``dt``
            disables the two resolutions).

    Returns:
        a `Plan`; ``table`` lists every candidate evaluated, best first (ties go to the smaller sum
        of thresholds: less waiting for the same throughput).
    """
    names = list(latency)
    if n < 1:
        raise ValueError(f"concurrency must be >= 1, got {n}")
    cands = feasible_thresholds(names, n)
    mode = search if search != "auto" else ("exhaustive" if len(cands) <= max_exhaustive else "pruned")
    if mode not in ("exhaustive", "pruned"):
        raise ValueError(f"search must be 'exhaustive', 'pruned' or 'auto', got {search!r}")
    memo: dict[tuple, DTMCResult] = {}
    feasible = {tuple(c[m] for m in names) for c in cands}

    def solve(key: tuple, tk: float) -> DTMCResult:
        return dtmc_throughput(
            latency, routing, n, dict(zip(names, key)), keep=keep, extra_tokens=extra_tokens, ticks=tk, **dtmc_kw
        )

    def ev(key: tuple) -> float:
        if key not in memo:
            memo[key] = solve(key, search_ticks)
            if progress is not None:
                progress(len(memo), len(cands) if mode == "exhaustive" else None)
        return memo[key].tok_s

    if mode == "exhaustive":
        for c in sorted(feasible):
            ev(c)
    else:
        grid = sorted({1 << k for k in range(n.bit_length()) if 1 << k <= n} | {n})
        for c in itertools.product(grid, repeat=len(names)):
            if c in feasible:
                ev(c)
        moves = [
            d
            for d in itertools.product((-1, 0, 1), repeat=len(names))
            if sum(map(abs, d)) == 1 or (sum(map(abs, d)) == 2 and sum(d) == 0)
        ]
        for cur in sorted(memo, key=lambda k: -memo[k].tok_s)[:3]:
            step = max(1, 1 << max(0, (n // 4).bit_length() - 1))
            while step >= 1:
                nbrs = [k for k in (tuple(c + step * x for c, x in zip(cur, d)) for d in moves) if k in feasible]
                best = max(nbrs, key=ev, default=cur)
                if ev(best) > ev(cur):
                    cur = best
                else:
                    step //= 2

    def rank(k):
        return (-memo[k].tok_s, sum(k), k)

    if search_ticks != ticks and "dt" not in dtmc_kw:
        for k in sorted(memo, key=rank)[: max(1, refine)]:
            memo[k] = solve(k, ticks)
        top_keys = sorted(memo, key=rank)[: max(1, refine)]
        refined = set(top_keys)
    else:
        refined = set(memo)
    order = sorted(memo, key=rank)
    pick = min(refined, key=rank)
    order.remove(pick)
    order.insert(0, pick)
    table = [
        {
            "thresholds": dict(zip(names, k)),
            "tok_s": memo[k].tok_s,
            "busy": memo[k].busy,
            "mean_batch": memo[k].mean_batch,
            "states": memo[k].states,
            "dt": memo[k].dt,
        }
        for k in order
    ]
    top = memo[pick]
    return Plan(
        thresholds=dict(zip(names, pick)),
        predicted_tok_s=top.tok_s,
        table=table,
        n=n,
        candidates=len(cands),
        search=mode,
        best=top,
    )


def plan_from_trace(router_or_trace, latency: dict[str, LatencyModel], n: int, **kw) -> Plan:
    """`plan_thresholds` with routing probabilities, the commit rule and extra fed tokens
    estimated from a pilot run (`estimate_routing`, `estimate_keep`, `estimate_extra_tokens`)."""
    names = list(latency)
    trace = _trace(router_or_trace)
    kw.setdefault("keep", estimate_keep(trace, names))
    kw.setdefault("extra_tokens", estimate_extra_tokens(trace, names))
    return plan_thresholds(latency, estimate_routing(trace, names), n, **kw)
