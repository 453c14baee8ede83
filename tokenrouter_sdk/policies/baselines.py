"""Baselines: single-model policies and random token-level routing.

`RandomRouting` follows R2R's ``RandomSwitching`` (thu-nics/R2R, ``r2r/utils/switching.py``;
arXiv 2505.21600): on each step of the small model, with probability ``p`` the sampled token
is discarded and the large model writes exactly one token, then control returns. Unlike R2R's
code the draws are seeded per request and position (from the seed and the request's key), so
runs are reproducible and no generator state travels with a handoff.
"""

from __future__ import annotations

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
