"""Delayed-batching planner: a discrete-time Markov chain (DTMC) throughput model and a threshold search.

Source: the TokenRouter paper (arXiv 2610.12242), appendix "performance model": a DTMC whose state is
each model's queue length, the batch size of its running step and the step's remaining time, driven
by the concurrency N, per-model routing probabilities and per-model step latency as a function of
batch size; its steady state gives committed tokens per second for each feasible threshold vector
(sum_i (B_i - 1) < N), and delayed batching uses the best one (DESIGN.md, "Performance model").
The paper body is not available to us in full; the chain below is our reconstruction of it from the
description above and the scheduler's launch rule (`SubServer.delayed_ok`).

The model (two models; index 0 is the entry model, e.g. ``"small"``):
  * N requests circulate forever (closed network: a finished request is replaced at once by a new
    one on the entry model, which is what ``max_concurrency=N`` with a long queue does).
  * Time is cut into ticks of ``dt`` seconds. A request in model i's queue waits. When model i is
    idle and its queue holds >= B_i requests (or any request, if the thresholds are infeasible for
    N: the tail rule), it launches one step over all of them (at most ``max_batch``); the step
    takes ``latency_i(b) + per_token_s * b * extra_tokens_i`` seconds, rounded to ticks
    (stochastically by default: floor or ceil with the probabilities that keep the mean exact).
  * When the step ends, each of its b requests independently leaves to the other model with
    probability q_i (a handoff) or rejoins model i's queue (so the run length of a request on a
    model is geometric). Every request that stays commits one token; one that leaves commits one
    if model i keeps its sampled token on handoff (``keep[i]``), none if it discards it (R2R /
    `RandomRouting`: the small model discards, the large one writes exactly one token and
    returns, q_large = 1, keep_large = 1).
  * Committed tokens per second = expected tokens committed per tick in steady state / dt.

Between two step completions the tick chain moves deterministically (every remaining time counts
down by one), so it is solved exactly through its embedded chain at completion epochs: states are
the configurations right after a completion (and the launches it allows), and throughput is
E[tokens per epoch] / E[ticks per epoch] under the embedded chain's stationary law (renewal-reward).
The stationary law is found with restarted GMRES (numpy only) on ``(I - P^T + 1 1^T / n) pi = 1/n``.

Assumptions (what the model ignores; see `evals/planner_check.py` for how far it is off):
  * stationary routing probabilities: q_i does not change over a request's life or with load;
  * independent requests: each request's routing draw is independent of the others in its batch;
  * geometric run lengths: a request's number of consecutive steps on model i is geometric with
    mean 1/q_i (true for `RandomRouting`; a policy with bursts of hard tokens violates it);
  * steady-state decode: prefill and the variable cost of extends are folded into a mean extra
    fed-token cost per request-step (``extra_tokens``), the workload's start and drain are not
    modelled (N is constant), and scheduler overhead is zero (as in the sim backend).

Size and speed: the embedded chain has ~17k states at N = 32 with 2 ticks per shortest step (the
search resolution of `plan_thresholds`), ~35k with 4; one solve takes 0.1-0.5 s on one CPU core,
a pruned N = 32 plan ~50 solves. ``max_states`` guards the size (the tick is coarsened, then
`StateSpaceTooLarge` is raised). Against the sim backend (`evals/planner_check.py`) the prediction
is a few percent high: the sim's whole-run throughput includes the start (all N requests enter
at once) and the drain of the workload, which the steady-state chain does not see.

Usage (what ``thresholds="auto"`` does): a short pilot run for the inputs, then the plan::

    pilot = Router(lat, policy, backend="sim", max_concurrency=N)     # or the real models
    pilot.generate(prompts, max_new_tokens=128)
    plan = plan_from_trace(pilot, lat, N)    # lat: {name: LatencyModel}, e.g. from profile_latency
    Router(lat, policy, backend="sim", mode="delayed", thresholds=plan.thresholds, max_concurrency=N)

Also here: `profile_latency` (decode-step latency of a real model as a function of batch size,
through `TorchRunner`), `estimate_routing` and friends (per-model inputs from a pilot run's event
trace) and `plan_thresholds` (search of the feasible thresholds).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .backends.sim_runner import LatencyModel

__all__ = ["profile_latency", "estimate_routing", "estimate_keep", "estimate_extra_tokens", "DTMCResult",
           "StateSpaceTooLarge", "estimate_step_overhead", "router_latency", "plan_router", "plan_for_router",
           "dtmc_throughput", "Plan", "feasible_thresholds", "plan_thresholds", "plan_from_trace"]


# ---------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------
def profile_latency(runner_or_model, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), *, context: int = 64,
                    steps: int = 5, warmup: int = 2, extend_tokens: int = 16, vocab_limit: int | None = None,
                    seed: int = 0) -> LatencyModel:
    """Measure one model's decode-step latency as a function of batch size.

    For each batch size b: prefill b requests of ``context`` random tokens, run ``warmup`` decode
    steps, then time ``steps`` more (one token per request each, KV growing as in serving) and keep
    the median. ``per_token_s`` comes from one extend of ``extend_tokens`` tokens at batch size 1
    (seconds per fed token beyond the first). Blocks are freed afterwards.

    Args:
        runner_or_model: a `TorchRunner`, or a `transformers` causal LM (wrapped in a `TorchRunner`,
            which switches its attention implementation to the paged one, as `Router` does).
        batch_sizes: batch sizes to time.
        context: tokens in each request's KV before the timed steps.
        steps, warmup: timed and untimed decode steps per batch size.
        extend_tokens: size of the extend used for ``per_token_s`` (0 or 1: per_token_s = 0).
        vocab_limit: draw random token ids below this (default: the runner's vocabulary).
        seed: token draws.

    Returns:
        a `LatencyModel` with ``table = {b: median seconds}``.
    """
    import torch

    from .backends.torch_runner import SeqInput, TorchRunner

    runner = runner_or_model
    if not hasattr(runner, "forward") or not hasattr(runner, "pool"):
        need = (max(batch_sizes) + 1) * (context + warmup + steps + extend_tokens + 2)
        runner = TorchRunner(runner_or_model, max_kv_tokens=max(need, 1024))
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"profile_latency: batch_sizes must be >= 1, got {batch_sizes}")
    if steps < 1:
        raise ValueError(f"profile_latency: steps must be >= 1, got {steps}")
    vocab = vocab_limit or runner.vocab_size
    rng = np.random.default_rng(seed)
    pool = runner.pool

    def run(seqs: list[list[int]], tables: list[list[int]], lens: list[int], feed: list[list[int]]) -> float:
        inputs = []
        for toks, tab, n in zip(feed, tables, lens):
            pool.ensure(tab, n + len(toks))
            inputs.append(SeqInput(list(toks), n, tab))
        t0 = time.perf_counter()
        logits, _ = runner.forward(inputs)
        dt = time.perf_counter() - t0
        nxt = logits.argmax(-1).tolist()
        for i, toks in enumerate(feed):
            lens[i] += len(toks)
            seqs[i].extend(toks)
            seqs[i].append(int(nxt[i]) % vocab)
        return dt

    table: dict[int, float] = {}
    per_token_s = 0.0
    with torch.inference_mode():
        for b in sorted(set(int(x) for x in batch_sizes)):
            tables: list[list[int]] = [[] for _ in range(b)]
            try:
                seqs = [[] for _ in range(b)]
                lens = [0] * b
                run(seqs, tables, lens, [rng.integers(0, vocab, context).tolist() for _ in range(b)])
                times = []
                for k in range(warmup + steps):
                    dt = run(seqs, tables, lens, [[s[-1]] for s in seqs])
                    if k >= warmup:
                        times.append(dt)
                table[b] = statistics.median(times)
                if b == min(batch_sizes) and extend_tokens > 1:
                    ext = []
                    for _ in range(max(1, steps // 2 + 1)):
                        ext.append(run(seqs[:1], tables[:1], lens[:1],
                                       [rng.integers(0, vocab, extend_tokens).tolist()]))
                    dec = table[b] if b == 1 else run(seqs[:1], tables[:1], lens[:1], [[seqs[0][-1]]])
                    per_token_s = max(0.0, (statistics.median(ext) - dec) / (extend_tokens - 1))
            finally:
                for t in tables:
                    pool.free(t)
    return LatencyModel(table=table, per_token_s=per_token_s)


# ---------------------------------------------------------------------------------------------
# Inputs from a pilot run's trace
# ---------------------------------------------------------------------------------------------
def _trace(router_or_trace) -> list:
    tr = getattr(router_or_trace, "trace", router_or_trace)
    return list(tr)


def _models_of(trace: list, models: Sequence[str] | None) -> list[str]:
    if models is not None:
        return list(models)
    seen: list[str] = []
    for ev in trace:
        m = ev[1].model if ev[0] == "step" else (ev[2] if ev[0] == "commit" else None)
        if m is not None and m not in seen:
            seen.append(m)
    return seen


def estimate_routing(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per-model routing probabilities from a pilot run.

    q_i = P(a request leaves model i after a step of model i) = handoffs out of i / request-steps
    on i (the sum of i's batch sizes), from the event trace (``router.trace``: ``("hop", rid, src,
    dst, kept, t)`` and ``("step", StepDone)``). Models with no steps get q = 0.

    Args:
        router_or_trace: a `Router` (its engine trace) or a trace list.
        models: model names to report (default: those seen in the trace, in order of appearance).
    """
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    hops = {m: 0 for m in names}
    req_steps = {m: 0 for m in names}
    for ev in trace:
        if ev[0] == "hop" and ev[2] in hops:
            hops[ev[2]] += 1
        elif ev[0] == "step" and ev[1].model in req_steps:
            req_steps[ev[1].model] += ev[1].batch_size
    return {m: (hops[m] / req_steps[m] if req_steps[m] else 0.0) for m in names}


def estimate_keep(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per model, the fraction of its handoffs that commit the sampled token first (``kept``);
    models without handoffs get 1.0."""
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    kept = {m: [0, 0] for m in names}
    for ev in trace:
        if ev[0] == "hop" and ev[2] in kept:
            kept[ev[2]][0] += bool(ev[4])
            kept[ev[2]][1] += 1
    return {m: (k / n if n else 1.0) for m, (k, n) in kept.items()}


def estimate_extra_tokens(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per model, mean tokens fed per request-step beyond one (prefill and extend cost, folded
    into the DTMC's step time as ``per_token_s * b * extra``)."""
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    fed = {m: [0, 0] for m in names}
    for ev in trace:
        if ev[0] == "step" and ev[1].model in fed:
            fed[ev[1].model][0] += ev[1].tokens_fed - ev[1].batch_size
            fed[ev[1].model][1] += ev[1].batch_size
    return {m: (f / n if n else 0.0) for m, (f, n) in fed.items()}


# ---------------------------------------------------------------------------------------------
# The DTMC
# ---------------------------------------------------------------------------------------------
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
            pmf[b, k] = math.comb(b, k) * q ** k * (1 - q) ** (b - k)
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


def _gmres_stationary(src: np.ndarray, dst: np.ndarray, w: np.ndarray, n: int, *, tol: float = 1e-11,
                      restart: int = 60, max_iter: int = 4000) -> tuple[np.ndarray, float]:
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
                h = np.einsum("ij,j->i", V[:k + 1], wv)  # einsum, not BLAS: a threaded BLAS on
                wv -= np.einsum("ij,i->j", V[:k + 1], h)  # busy cores is 20x slower here
                H[:k + 1, k] += h
            H[k + 1, k] = norm(wv)
            k_used = k + 1
            it += 1
            if H[k + 1, k] > 1e-14:
                V[k + 1] = wv / H[k + 1, k]
            e1 = np.zeros(k + 2)
            e1[0] = beta
            y, *_ = np.linalg.lstsq(H[:k + 2, :k + 1], e1, rcond=None)
            res = np.linalg.norm(H[:k + 2, :k + 1] @ y - e1)
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


def _solve_chain(N: int, B: tuple[int, int], q: tuple[float, float], keep: tuple[float, float],
                 fl: tuple[np.ndarray, np.ndarray], pc: tuple[np.ndarray, np.ndarray], cap: tuple[int, int],
                 max_states: int):
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
    known = front.copy()                      # sorted codes of the states found so far
    known_idx = np.arange(front.size, dtype=np.int64)
    n_states = front.size
    first = 0
    srcs, dsts, ws, rewards, holds, comps, busys = [], [], [], [], [], [], []
    big = np.int64(1) << 40
    while front.size:
        c = front
        r1 = c % dims[4]; c = c // dims[4]
        b1 = c % dims[3]; c = c // dims[3]
        r0 = c % dims[2]; c = c // dims[2]
        b0 = c % dims[1]; Q0 = c // dims[1]
        Q1 = N - Q0 - b0 - b1
        tau = np.minimum(np.where(b0 > 0, r0, big), np.where(b1 > 0, r1, big))
        if np.any(tau == big):
            raise RuntimeError(f"DTMC: both models wait below their thresholds {B} with N = {N} "
                               "(deadlock; the thresholds are infeasible)")
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
        a = dict(Q0=Q0[s] + np.where(C0, B0 - k0, 0) + np.where(C1, k1, 0),
                 Q1=Q1[s] + np.where(C1, B1 - k1, 0) + np.where(C0, k0, 0),
                 b0=np.where(C0, 0, B0), b1=np.where(C1, 0, B1),
                 r0=np.where(C0 | (B0 == 0), 0, r0[s] - T), r1=np.where(C1 | (B1 == 0), 0, r1[s] - T),
                 p=prob, src=s + first)
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
        srcs.append(a["src"]); dsts.append(dst); ws.append(a["p"])
        first += front.size
        n_states += new.size
        if n_states > max_states:
            raise StateSpaceTooLarge(f"the DTMC needs more than {max_states} states")
        front = new
    src, dst, w = np.concatenate(srcs), np.concatenate(dsts), np.concatenate(ws)
    pi, resid = _gmres_stationary(src, dst, w, n_states)
    return (pi, np.concatenate(rewards), np.concatenate(holds), np.concatenate(comps),
            np.concatenate(busys), resid)


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


def dtmc_throughput(latency: dict[str, LatencyModel], routing: dict[str, float], n: int,
                    thresholds: dict[str, int], *, keep: dict[str, float] | None = None,
                    extra_tokens: dict[str, float] | None = None, max_batch: int | None = None,
                    dt: float | None = None, ticks: int = 4, rounding: str = "stochastic",
                    max_states: int = 400_000) -> DTMCResult:
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
                    f"states even with ticks of {cur * 1e3:.3g} ms; raise max_states or pass a larger dt") from None
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
        states=int(pi.size), dt=cur, residual=resid)


# ---------------------------------------------------------------------------------------------
# Threshold search
# ---------------------------------------------------------------------------------------------
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
    """Every threshold vector with B_i >= 1 and sum_i (B_i - 1) < n (DESIGN.md invariant 7: below
    that, every model can wait under its threshold forever)."""
    models = list(models)
    out = []
    for slack in itertools.product(range(n), repeat=len(models)):
        if sum(slack) < n:
            out.append({m: s + 1 for m, s in zip(models, slack)})
    return out


def plan_thresholds(latency: dict[str, LatencyModel], routing: dict[str, float], n: int, *,
                    keep: dict[str, float] | None = None, extra_tokens: dict[str, float] | None = None,
                    search: str = "auto", max_exhaustive: int = 160, search_ticks: float = 2, ticks: float = 4,
                    refine: int = 5, progress=None, **dtmc_kw) -> Plan:
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
        return dtmc_throughput(latency, routing, n, dict(zip(names, key)), keep=keep, extra_tokens=extra_tokens,
                               ticks=tk, **dtmc_kw)

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
        moves = [d for d in itertools.product((-1, 0, 1), repeat=len(names))
                 if sum(map(abs, d)) == 1 or (sum(map(abs, d)) == 2 and sum(d) == 0)]
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
        for k in sorted(memo, key=rank)[:max(1, refine)]:
            memo[k] = solve(k, ticks)
        top_keys = sorted(memo, key=rank)[:max(1, refine)]
        refined = set(top_keys)
    else:
        refined = set(memo)
    order = sorted(memo, key=rank)
    pick = min(refined, key=rank)
    order.remove(pick)
    order.insert(0, pick)
    table = [{"thresholds": dict(zip(names, k)), "tok_s": memo[k].tok_s, "busy": memo[k].busy,
              "mean_batch": memo[k].mean_batch, "states": memo[k].states, "dt": memo[k].dt} for k in order]
    top = memo[pick]
    return Plan(thresholds=dict(zip(names, pick)), predicted_tok_s=top.tok_s, table=table, n=n,
                candidates=len(cands), search=mode, best=top)


def plan_from_trace(router_or_trace, latency: dict[str, LatencyModel], n: int, **kw) -> Plan:
    """`plan_thresholds` with routing probabilities, the commit rule and extra fed tokens
    estimated from a pilot run (`estimate_routing`, `estimate_keep`, `estimate_extra_tokens`)."""
    names = list(latency)
    trace = _trace(router_or_trace)
    kw.setdefault("keep", estimate_keep(trace, names))
    kw.setdefault("extra_tokens", estimate_extra_tokens(trace, names))
    return plan_thresholds(latency, estimate_routing(trace, names), n, **kw)


# ---------------------------------------------------------------------------------------------
# For a Router (thresholds="auto", the benchmark)
# ---------------------------------------------------------------------------------------------
PILOT_PROMPTS = ("Explain why the sky is blue in a few sentences.",
                 "What is 17 * 23? Show your steps.",
                 "Write a short story about a robot who learns to paint.",
                 "List three uses of a paperclip and explain each one.",
                 "Summarise the water cycle for a ten-year-old.",
                 "Give two arguments for and against homework.")

_PROFILES = None  # weakref.WeakKeyDictionary: model -> LatencyModel (filled by router_latency)


def estimate_step_overhead(router_or_trace, models: Sequence[str] | None = None) -> dict[str, float]:
    """Per model, mean seconds of a step spent outside the model forward (batch building, sampling,
    routing, events: ``t_end - t_start - forward_s`` of its ``StepDone`` events)."""
    trace = _trace(router_or_trace)
    names = _models_of(trace, models)
    acc = {m: [0.0, 0] for m in names}
    for ev in trace:
        if ev[0] == "step" and ev[1].model in acc:
            s = ev[1]
            acc[s.model][0] += max(0.0, (s.t_end - s.t_start) - s.forward_s)
            acc[s.model][1] += 1
    return {m: (t / k if k else 0.0) for m, (t, k) in acc.items()}


def router_latency(router, n: int = 16, **profile_kw) -> dict[str, LatencyModel]:
    """Each model's `LatencyModel`: the sim backend's own, or `profile_latency` of the loaded
    model (batch sizes 1, 2, 4, ... up to max(n, 16); cached per model object, so a benchmark
    profiles each model once). Profiling runs on a private KV pool; call it while the Router is
    idle (it competes for the CPU with running requests)."""
    import weakref

    global _PROFILES
    if _PROFILES is None:
        _PROFILES = weakref.WeakKeyDictionary()
    out = {}
    top = max(16, n)
    sizes = tuple(sorted({1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top}))
    for name in router.models:
        runner = router.engine.runners[name]
        lat = getattr(runner, "latency", None)
        if isinstance(lat, LatencyModel):
            out[name] = lat
            continue
        model = router.models[name]
        cached = _PROFILES.get(model)
        if cached is None or max(cached.table) < top:
            cached = profile_latency(model, batch_sizes=sizes, **profile_kw)
            _PROFILES[model] = cached
        out[name] = cached
    return out


def plan_router(router, policy, n: int, *, trace: list | None = None, prompts: Sequence | None = None,
                pilot_tokens: int = 64, latency: dict[str, LatencyModel] | None = None, **kw) -> Plan:
    """Plan delayed-batching thresholds for ``router`` serving ``policy`` at concurrency ``n``.

    Inputs: latency from `router_latency` (unless given); routing, commit rule and extra fed
    tokens from ``trace`` if given, else analytically for `RandomRouting` (q_small = p,
    q_large = 1, the small discards, the large keeps, (1 - p) / p extra tokens per large step),
    else from a pilot run on the router itself: ``max(n, 4)`` requests of ``prompts`` (default
    `PILOT_PROMPTS`, cycled), ``pilot_tokens`` tokens each, at concurrency n with thresholds 1
    (restored afterwards). With a pilot trace on a real backend, the measured per-step overhead
    outside the forward is added to the profiled step times.

    Raises:
        ValueError: the router does not hold exactly two models (the DTMC covers two).
    """
    names = list(router.models)
    if len(names) != 2:
        raise ValueError(f"the planner covers two models (small, large), this Router has {names}")
    lat = dict(latency) if latency is not None else router_latency(router, n)
    if trace is None and type(policy).__name__ == "RandomRouting" and hasattr(policy, "p"):
        p = float(policy.p)
        small = getattr(policy, "small", None) or names[0]
        large = getattr(policy, "large", None) or names[-1]
        q = {small: p, large: 1.0}
        kw.setdefault("keep", {small: 0.0, large: 1.0})
        kw.setdefault("extra_tokens", {small: 0.0, large: (1 - p) / p if p > 0 else 0.0})
        return plan_thresholds(lat, q, n, **kw)
    if trace is None:
        eng = router.engine
        old = dict(getattr(eng, "thresholds", {}) or {})
        start = len(eng.trace)
        plist = list(prompts or PILOT_PROMPTS)
        plist = [plist[i % len(plist)] for i in range(max(n, 4))]
        if getattr(eng, "mode", None) == "delayed":
            router.set_thresholds({m: 1 for m in names})
        try:
            router.generate(plist, policy=policy, concurrency=n, max_new_tokens=pilot_tokens, ignore_eos=True)
        finally:
            if old and getattr(eng, "mode", None) == "delayed":
                router.set_thresholds(old)
        trace = list(eng.trace[start:])
        if not any(isinstance(getattr(r, "latency", None), LatencyModel) for r in eng.runners.values()):
            over = estimate_step_overhead(trace, names)
            lat = {m: LatencyModel({b: t + over[m] for b, t in lat[m].table.items()}, lat[m].per_token_s)
                   for m in names}
    kw.setdefault("keep", estimate_keep(trace, names))
    kw.setdefault("extra_tokens", estimate_extra_tokens(trace, names))
    return plan_thresholds(lat, estimate_routing(trace, names), n, **kw)


def plan_for_router(router, policy, n: int, **kw) -> dict[str, int]:
    """The thresholds of `plan_router` (what ``tokenrouter bench --thresholds auto`` uses)."""
    return plan_router(router, policy, n, **kw).thresholds
