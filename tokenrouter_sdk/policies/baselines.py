"""Baselines: single-model policies and random token-level routing.

`RandomRouting` follows R2R's ``RandomSwitching`` (thu-nics/R2R, ``r2r/utils/switching.py``;
arXiv 2505.21600): on each step of the small model, with probability ``p`` the sampled token
is discarded and the large model writes exactly one token, then control returns. Unlike R2R's
code the draws are seeded per request and position (from the seed and the request's key), so
runs are reproducible and no generator state travels with a handoff.

`RandomSpanRouting` is random routing with visits of a chosen mean length on each model
(geometric, so the writer sequence is a two-state Markov chain): the reference that matches a
policy on its large fraction *and* its mean visit lengths, hence on its hop rate, which
RandomRouting's one-token visits do not (its hop rate is about twice its large fraction).
"""

from __future__ import annotations

import math

from tokenrouter_sdk.policy import Handoff, Policy, Step, request_draw


class SingleModel(Policy):
    """Every token is written by ``model`` (the request is prefilled there: no handoffs)."""

    def __init__(self, model: str):
        self.model = model

    def entry(self, req, models):
        if self.model not in models:
            raise ValueError(f"SingleModel({self.model!r}): no such model, have {list(models)}")
        return self.model

    def may_use(self, req, models):
        return [req.owner]  # the entry model only: nothing to prefill elsewhere

    def route(self, step: Step) -> str:
        return self.model


class SmallOnly(SingleModel):
    """The first (smallest) model writes everything."""

    def __init__(self):
        self.model = None

    def entry(self, req, models):
        return models[0]

    def route(self, step: Step) -> str:
        return step.models[0]


class LargeOnly(SingleModel):
    """The last (largest) model writes everything."""

    def __init__(self):
        self.model = None

    def entry(self, req, models):
        return models[-1]

    def route(self, step: Step) -> str:
        return step.models[-1]


class RandomRouting(Policy):
    """Per small-model step, with probability ``p`` discard the small token and let the large
    model write one token (R2R ``RandomSwitching``, defaults p=0.5, seed=42 there).

    Args:
        p: routing probability per small-model step, in [0, 1].
        seed: base seed; the draw at output position i is `request_draw` ``(seed, request, i)``.
        small, large: model names (default: first and last model).
    """

    def __init__(self, p: float = 0.5, seed: int = 42, small: str | None = None, large: str | None = None):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomRouting: p must be in [0, 1], got {p}")
        self.p, self.seed, self.small, self.large = p, seed, small, large

    def route(self, step: Step) -> str:
        small = self.small or step.models[0]
        large = self.large or step.models[-1]
        if step.model == small and request_draw(self.seed, step.request, step.position) < self.p:
            return large
        return step.model

    def send(self, req, target) -> Handoff:
        return Handoff(keep_sampled=False, span=1)


def geometric_span(u: float, mean: float) -> int:
    """A Geometric draw on {1, 2, ...} with mean ``mean`` (>= 1; inf: never ends, 2**30) by
    inversion of ``u`` in [0, 1)."""
    if not math.isfinite(mean):
        return 1 << 30
    q = 1.0 / mean
    if q >= 1.0:
        return 1
    return 1 + min(1 << 30, int(math.log1p(-u) / math.log1p(-q)))


class RandomSpanRouting(Policy):
    """Random routing with geometric visits: the large model writes spans of ``large_visit``
    tokens on average, the small model stretches of ``small_visit`` tokens between them. At
    each small-model step the request hands off with probability q = 1 / (1 + ``small_visit``)
    (the sampled token is discarded and the large model writes that position; a stretch may be
    empty: a request just returned can go straight back up), and each large span's length is
    drawn at the hand-off (Geometric on {1, 2, ...}, mean ``large_visit``). So both visit
    lengths are geometric with those means, the large fraction tends to
    ``large_visit / (large_visit + small_visit)`` and the hops per committed token to
    ``2 / (large_visit + small_visit)``. `RandomRouting` (p) is the case ``large_visit=1``,
    ``small_visit=(1 - p) / p``. `evaluate_policy`'s span-matched reference sets both means to
    the ones a policy realised, counted at its handoffs.

    Args:
        large_visit: mean tokens per large visit, >= 1 (inf: the large model keeps the request).
        small_visit: mean tokens per small stretch, >= 0 (inf: never hands off).
        seed: base seed; draws are `request_draw` ``(seed, request, 2 * position)`` for the
            hand-off and ``2 * position + 1`` for the span, so runs are reproducible.
        small, large: model names (default: first and last model).

    Raises:
        ValueError: ``large_visit`` below 1 or ``small_visit`` below 0 (or not numbers).
    """

    def __init__(
        self,
        large_visit: float = 2.0,
        small_visit: float = 8.0,
        seed: int = 0,
        small: str | None = None,
        large: str | None = None,
    ):
        for name, v, least in (("large_visit", large_visit, 1), ("small_visit", small_visit, 0)):
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= least):
                raise ValueError(
                    f"RandomSpanRouting: {name} is a mean visit length in tokens, >= {least} (inf for "
                    f"never ending), got {v!r}"
                )
        self.large_visit, self.small_visit = float(large_visit), float(small_visit)
        self.seed, self.small, self.large = seed, small, large

    def route(self, step: Step) -> str:
        small = self.small or step.models[0]
        if step.model != small or math.isinf(self.small_visit):  # a large span ends by itself (Handoff.span)
            return step.model
        if request_draw(self.seed, step.request, 2 * step.position) < 1.0 / (1.0 + self.small_visit):
            return self.large or step.models[-1]
        return step.model

    def send(self, req, target) -> Handoff:
        if target != (self.large or req.models[-1]):
            return Handoff(keep_sampled=False)
        return Handoff(
            keep_sampled=False,
            span=geometric_span(request_draw(self.seed, req, 2 * req.n_generated + 1), self.large_visit),
        )
