"""The DTMC throughput model of delayed batching (see the package docstring for the chain)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backends.sim_runner import LatencyModel


@dataclass
class DTMCResult:
    """Steady state of the DTMC for one threshold vector.

    Attributes:
        tok_s: predicted committed tokens per second.
        thresholds: the B_i used.
        busy: per model, fraction of time stepping.
        mean_batch: per model, mean batch size of its steps.
        steps_s: per model, steps per second.
        states: states of the embedded chain; dt: tick length (seconds).
        residual: ||(I - P^T) pi||_1 of the solution.
    """

    tok_s: float
    thresholds: dict[str, int]
    busy: dict[str, float]
    mean_batch: dict[str, float]
    steps_s: dict[str, float]
    states: int
    dt: float
    residual: float


class StateSpaceTooLarge(RuntimeError):
    """The embedded chain would exceed ``max_states`` even at the coarsest allowed tick."""


def _binom_table(n: int, q: float) -> np.ndarray:
    """pmf[b, k] = P(Binomial(b, q) = k), for 0 <= k <= b <= n."""
    pmf = np.zeros((n + 1, n + 1))
    for b in range(n + 1):
        for k in range(b + 1):
            pmf[b, k] = math.comb(b, k) * q**k * (1 - q) ** (b - k)
    return pmf


def _durations(step_s: np.ndarray, dt: float, rounding: str) -> tuple[np.ndarray, np.ndarray]:
    """Per batch size: (floor ticks f >= 1, probability of f + 1 ticks). ``nearest`` gives
    probability 0 (and f = the rounded value)."""
    x = step_s / dt
    if rounding == "nearest":
        return np.maximum(1, np.rint(x)).astype(np.int64), np.zeros_like(x)
    if rounding != "stochastic":
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    f = np.floor(x)
    p = x - f
    low = f < 1
    f[low], p[low] = 1, 0.0
    return f.astype(np.int64), p


def _gmres_stationary(
    src: np.ndarray,
    dst: np.ndarray,
    w: np.ndarray,
    n: int,
    *,
    tol: float = 1e-11,
    restart: int = 60,
    max_iter: int = 4000,
) -> tuple[np.ndarray, float]:
    """Stationary law pi of the chain with edges (src -> dst, prob w): solves
    (I - P^T + 1 1^T / n) pi = 1 / n with restarted GMRES (unique solution when the chain has
    one recurrent class). Returns (pi clipped to >= 0 and normalised, residual)."""

    def norm(x):
        return float(np.sqrt(np.einsum("i,i->", x, x)))

    def pt(x):  # P^T x
        return np.bincount(dst, weights=w * x[src], minlength=n)

    def mv(x):
        return x - pt(x) + x.sum() / n

    b = np.full(n, 1.0 / n)
    # a few power steps give a good start
    x = b.copy()
    for _ in range(6):
        x = 0.5 * (x + pt(x))
    bnorm = norm(b)
    it = 0
    while it < max_iter:
        r = b - mv(x)
        beta = norm(r)
        if beta <= tol * bnorm:
            break
        m = min(restart, max_iter - it)
        V = np.zeros((m + 1, n))
        H = np.zeros((m + 1, m))
        V[0] = r / beta
        k_used = 0
        for k in range(m):
            wv = mv(V[k])
            for _ in range(2):  # classical Gram-Schmidt, twice (numerically as good as modified);
                h = np.einsum("ij,j->i", V[: k + 1], wv)  # einsum, not BLAS: a threaded BLAS on
                wv -= np.einsum("ij,i->j", V[: k + 1], h)  # busy cores is 20x slower here
                H[: k + 1, k] += h
            H[k + 1, k] = norm(wv)
            k_used = k + 1
            it += 1
            if H[k + 1, k] > 1e-14:
                V[k + 1] = wv / H[k + 1, k]
            e1 = np.zeros(k + 2)
            e1[0] = beta
            y, *_ = np.linalg.lstsq(H[: k + 2, : k + 1], e1, rcond=None)
            res = np.linalg.norm(H[: k + 2, : k + 1] @ y - e1)
            if res <= tol * bnorm or H[k + 1, k] <= 1e-14:
                break
        x = x + np.einsum("ij,i->j", V[:k_used], y)
    x = np.clip(x, 0.0, None)
    x /= x.sum()
    resid = float(np.abs(x - pt(x)).sum())
    return x, resid


def _launch(a: dict, B: tuple[int, int], tail: bool, fl, pc, cap) -> dict:
    """Idle models whose queue reached the threshold launch a step over their whole queue (at most
    ``cap``); each launch branches on the stochastic rounding of its duration. ``a`` holds the
    arrays Q0, Q1, b0, r0, b1, r1, p (probability) and src (row of origin)."""
    for i in (0, 1):
        Q, b, r = a[f"Q{i}"], a[f"b{i}"], a[f"r{i}"]
        go = (b == 0) & (Q >= (1 if tail else B[i])) & (Q > 0)
        nb = np.where(go, np.minimum(Q, cap[i]), b)
        nQ = Q - np.where(go, nb, 0)
        f = fl[i][np.maximum(nb, 1)]
        pu = np.where(go, pc[i][np.maximum(nb, 1)], 0.0)
        lo = dict(a, **{f"Q{i}": nQ, f"b{i}": nb, f"r{i}": np.where(go, f, r), "p": a["p"] * (1.0 - pu)})
        hi = dict(a, **{f"Q{i}": nQ, f"b{i}": nb, f"r{i}": np.where(go, f + 1, r), "p": a["p"] * pu})
        m = hi["p"] > 0
        if m.any():
            a = {k: np.concatenate([lo[k], hi[k][m]]) for k in lo}
        else:
            a = lo
    return a


def _solve_chain(
    N: int,
    B: tuple[int, int],
    q: tuple[float, float],
    keep: tuple[float, float],
    fl: tuple[np.ndarray, np.ndarray],
    pc: tuple[np.ndarray, np.ndarray],
    cap: tuple[int, int],
    max_states: int,
):
    """Build the embedded chain by breadth-first search from 'all N queued on model 0' and solve it.

    State (right after completions and launches): (Q0, b0, r0, b1, r1) with Q1 = N - Q0 - b0 - b1;
    b_i = 0 means model i is idle (then r_i = 0). From a state, the next epoch is tau = the
    smallest remaining time of a running step; the models whose step ends then split their batch
    binomially, the other running step's remaining time drops by tau, idle models launch.

    Returns (pi, reward per epoch, ticks per epoch, batch completed per model per epoch [n, 2],
    busy flags [n, 2], residual). Raises StateSpaceTooLarge past ``max_states``.
    """
    R0, R1 = int(fl[0].max()) + 1, int(fl[1].max()) + 1
    dims = (N + 1, N + 1, R0 + 1, N + 1, R1 + 1)
    pmf = (_binom_table(N, q[0]), _binom_table(N, q[1]))
    tail = sum(b - 1 for b in B) >= N
    cr = tuple((1 - q[i]) + q[i] * keep[i] for i in (0, 1))  # tokens committed per request-step

    def encode(a):
        return (((a["Q0"] * dims[1] + a["b0"]) * dims[2] + a["r0"]) * dims[3] + a["b1"]) * dims[4] + a["r1"]

    z = np.zeros(1, dtype=np.int64)
    a0 = _launch(dict(Q0=z + N, Q1=z, b0=z, r0=z, b1=z, r1=z, p=np.ones(1), src=z), B, tail, fl, pc, cap)
    front = np.unique(encode(a0))
    known = front.copy()  # sorted codes of the states found so far
    known_idx = np.arange(front.size, dtype=np.int64)
    n_states = front.size
    first = 0
    srcs, dsts, ws, rewards, holds, comps, busys = [], [], [], [], [], [], []
    big = np.int64(1) << 40
    while front.size:
        c = front
        c, r1 = divmod(c, dims[4])
        c, b1 = divmod(c, dims[3])
        c, r0 = divmod(c, dims[2])
        Q0, b0 = divmod(c, dims[1])
        Q1 = N - Q0 - b0 - b1
        tau = np.minimum(np.where(b0 > 0, r0, big), np.where(b1 > 0, r1, big))
        if np.any(tau == big):
            raise RuntimeError(
                f"DTMC: both models wait below their thresholds {B} with N = {N} "
                "(deadlock; the thresholds are infeasible)"
            )
        c0 = (b0 > 0) & (r0 == tau)
        c1 = (b1 > 0) & (r1 == tau)
        rewards.append(np.where(c0, b0 * cr[0], 0.0) + np.where(c1, b1 * cr[1], 0.0))
        holds.append(tau.astype(float))
        comps.append(np.stack([np.where(c0, b0, 0), np.where(c1, b1, 0)], 1))
        busys.append(np.stack([b0 > 0, b1 > 0], 1))
        # binomial branching of the completing batches
        n0 = np.where(c0, b0 + 1, 1)
        n1 = np.where(c1, b1 + 1, 1)
        cnt = n0 * n1
        s = np.repeat(np.arange(front.size), cnt)
        off = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        k0, k1 = off // n1[s], off % n1[s]
        C0, C1, B0, B1 = c0[s], c1[s], b0[s], b1[s]
        prob = np.where(C0, pmf[0][B0, np.minimum(k0, B0)], 1.0) * np.where(C1, pmf[1][B1, np.minimum(k1, B1)], 1.0)
        T = tau[s]
        a = dict(
            Q0=Q0[s] + np.where(C0, B0 - k0, 0) + np.where(C1, k1, 0),
            Q1=Q1[s] + np.where(C1, B1 - k1, 0) + np.where(C0, k0, 0),
            b0=np.where(C0, 0, B0),
            b1=np.where(C1, 0, B1),
            r0=np.where(C0 | (B0 == 0), 0, r0[s] - T),
            r1=np.where(C1 | (B1 == 0), 0, r1[s] - T),
            p=prob,
            src=s + first,
        )
        m = prob > 0
        a = _launch({k: v[m] for k, v in a.items()}, B, tail, fl, pc, cap)
        codes = encode(a)
        new = np.unique(codes)
        pos = np.minimum(np.searchsorted(known, new), known.size - 1)
        new = new[known[pos] != new]
        allc = np.concatenate([known, new])
        alli = np.concatenate([known_idx, np.arange(n_states, n_states + new.size, dtype=np.int64)])
        o = np.argsort(allc, kind="stable")
        known, known_idx = allc[o], alli[o]
        dst = known_idx[np.searchsorted(known, codes)]
        srcs.append(a["src"])
        dsts.append(dst)
        ws.append(a["p"])
        first += front.size
        n_states += new.size
        if n_states > max_states:
            raise StateSpaceTooLarge(f"the DTMC needs more than {max_states} states")
        front = new
    src, dst, w = np.concatenate(srcs), np.concatenate(dsts), np.concatenate(ws)
    pi, resid = _gmres_stationary(src, dst, w, n_states)
    return (pi, np.concatenate(rewards), np.concatenate(holds), np.concatenate(comps), np.concatenate(busys), resid)


def _as_pair(x, names: list[str], what: str, default=None) -> tuple:
    if x is None:
        if default is None:
            raise ValueError(f"{what}: missing")
        x = default
    if isinstance(x, dict):
        missing = [m for m in names if m not in x]
        if missing:
            raise ValueError(f"{what} has no entry for model(s) {missing}; got {sorted(x)}")
        return tuple(x[m] for m in names)
    return tuple(x)


def _step_seconds(lat: LatencyModel, n: int, extra: float) -> np.ndarray:
    """Seconds of a step of b = 0..n requests (index 0 unused) with ``extra`` fed tokens per request."""
    s = np.zeros(n + 1)
    for b in range(1, n + 1):
        s[b] = lat.step_s(b) + lat.per_token_s * b * extra
    return s


def dtmc_throughput(
    latency: dict[str, LatencyModel],
    routing: dict[str, float],
    n: int,
    thresholds: dict[str, int],
    *,
    keep: dict[str, float] | None = None,
    extra_tokens: dict[str, float] | None = None,
    max_batch: int | None = None,
    dt: float | None = None,
    ticks: int = 4,
    rounding: str = "stochastic",
    max_states: int = 400_000,
) -> DTMCResult:
    """Steady-state committed tokens per second of delayed batching (see the module docstring).

    Args:
        latency: two models, entry model first (e.g. ``{"small": ..., "large": ...}``), each a
            `LatencyModel` (step seconds as a function of batch size; its ``per_token_s`` prices
            ``extra_tokens``).
        routing: q_i per model: probability that a request leaves model i after one of its steps.
        n: concurrency N (requests in flight).
        thresholds: B_i per model (missing models: 1).
        keep: per model, the fraction of handoffs that commit the sampled token first. Default:
            R2R / `RandomRouting` semantics, 0 for the entry model (it discards) and 1 for the
            other (its forced one-token span commits).
        extra_tokens: per model, mean fed tokens per request-step beyond one (prefill, extend; see
            `estimate_extra_tokens`). Default 0.
        max_batch: requests per step at most (default N).
        dt: tick length in seconds. Default: the shortest step (batch 1) / ``ticks``; coarsened
            (x1.5 at a time, down to 2 ticks for the shortest step) when the chain would exceed
            ``max_states`` states.
        rounding: step durations in ticks, ``"stochastic"`` (floor or ceil, mean exact) or
            ``"nearest"``.
        max_states: size guard of the embedded chain.

    Raises:
        ValueError: not two models, bad probabilities, or thresholds < 1.
        StateSpaceTooLarge: the chain exceeds ``max_states`` even at the coarsest tick.
    """
    names = list(latency)
    if len(names) != 2:
        raise ValueError(f"the DTMC covers two models (entry model first), got {names}")
    if n < 1:
        raise ValueError(f"concurrency N must be >= 1, got {n}")
    q = tuple(float(v) for v in _as_pair(routing, names, "routing"))
    if any(not 0.0 <= v <= 1.0 for v in q):
        raise ValueError(f"routing probabilities must lie in [0, 1], got {dict(zip(names, q))}")
    kp = tuple(float(v) for v in _as_pair(keep, names, "keep", default=(0.0, 1.0)))
    ex = tuple(float(v) for v in _as_pair(extra_tokens, names, "extra_tokens", default=(0.0, 0.0)))
    B = tuple(int(thresholds.get(m, 1)) for m in names)
    if min(B) < 1:
        raise ValueError(f"thresholds must be >= 1, got {thresholds}")
    cap_b = int(max_batch or n)
    cap = (min(cap_b, n), min(cap_b, n))
    secs = tuple(_step_seconds(latency[m], n, e) for m, e in zip(names, ex))
    shortest = min(s[1:].min() for s in secs)
    cur = dt if dt is not None else shortest / ticks
    coarsest = shortest / 2
    while True:
        fl, pc = zip(*(_durations(s, cur, rounding) for s in secs))
        try:
            pi, rew, hold, comp, busy, resid = _solve_chain(n, B, q, kp, fl, pc, cap, max_states)
            break
        except StateSpaceTooLarge:
            if dt is not None or cur >= coarsest * 0.999:
                raise StateSpaceTooLarge(
                    f"the DTMC for N = {n}, thresholds {dict(zip(names, B))} needs more than {max_states} "
                    f"states even with ticks of {cur * 1e3:.3g} ms; raise max_states or pass a larger dt"
                ) from None
            cur = min(cur * 1.5, coarsest)

    def avg(x):  # no BLAS (see _gmres_stationary)
        return float(np.einsum("i,i->", pi, np.asarray(x, dtype=float)))

    mean_ticks = avg(hold)
    horizon = mean_ticks * cur  # seconds per epoch
    steps = [avg(comp[:, i] > 0) for i in (0, 1)]
    return DTMCResult(
        tok_s=avg(rew) / horizon,
        thresholds=dict(zip(names, B)),
        busy={m: avg(busy[:, i] * hold) / mean_ticks for i, m in enumerate(names)},
        mean_batch={m: (avg(comp[:, i]) / steps[i] if steps[i] > 0 else 0.0) for i, m in enumerate(names)},
        steps_s={m: float(steps[i]) / horizon for i, m in enumerate(names)},
        states=int(pi.size),
        dt=cur,
        residual=resid,
    )
