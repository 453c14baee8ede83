"""Token-level ensemble (ME) across 2+ models (TokenRouter paper, arXiv 2610.12242, evaluation:
"models are selected token by token using ensemble weights", Qwen3-0.6B/8B/32B with weights
0.5/0.3/0.2; no official code).

The writer of every output position is drawn from Categorical(w): the entry model (which
prefills and writes position 0) is drawn first, then after each step the writer of the next
position. On a handoff the just-sampled token is kept (it was written by the model drawn for
it), so the peer writes from the next position on; the peer span is one token, re-drawn.

Uncertain (the paper does not say): whether "ensemble weights" means choosing a writer (done
here) or averaging the models' distributions (sum_m w_m p_m, which needs every model to run
every token in lockstep: not a handoff pattern); which weight goes with which model (here:
models smallest first, 0.5/0.3/0.2 for three models; equal weights for other counts).
"""

from __future__ import annotations

from typing import Sequence

from tokenrouter_sdk.policy import Handoff, Policy, Step, request_draw, weighted_pick

DEFAULT_WEIGHTS_3 = (0.5, 0.3, 0.2)


class TokenEnsemble(Policy):
    """Args:
    weights: ``{model: w}`` (models left out get 0) or a list aligned with the models
        (smallest first); non-negative, summing to > 0; normalised. None: 0.5/0.3/0.2 for
        three models, equal weights otherwise.
    seed: base seed; the writer of output position i is picked by `request_draw`
        ``(seed, request, i)`` (position 0: the entry model), like `RandomRouting`.
    """

    def __init__(self, weights: dict[str, float] | Sequence[float] | None = None, seed: int = 0):
        if weights is not None:
            vals = list(weights.values()) if isinstance(weights, dict) else list(weights)
            if any(not w >= 0 for w in vals):  # also rejects NaN
                raise ValueError(f"TokenEnsemble: weights must be non-negative, got {weights}")
            if sum(vals) <= 0:
                raise ValueError(f"TokenEnsemble: weights must sum to > 0, got {weights}")
            weights = dict(weights) if isinstance(weights, dict) else vals
        self.weights, self.seed = weights, seed

    def probs(self, models: Sequence[str]) -> list[float]:
        """The normalised weights aligned with ``models``; ValueError if they do not fit."""
        w = self.weights
        if w is None:
            w = list(DEFAULT_WEIGHTS_3) if len(models) == 3 else [1.0] * len(models)
        elif isinstance(w, dict):
            unknown = sorted(set(w) - set(models))
            if unknown:
                raise ValueError(f"TokenEnsemble: weights name unknown models {unknown}; the models are {list(models)}")
            w = [w.get(m, 0.0) for m in models]
        elif len(w) != len(models):
            raise ValueError(
                f"TokenEnsemble: {len(w)} weights for {len(models)} models {list(models)}; "
                "give one weight per model (smallest first) or a dict"
            )
        return [x / sum(w) for x in w]

    def writer(self, req, models: Sequence[str], position: int) -> str:
        """The model that writes output position ``position`` of ``req``."""
        return weighted_pick(list(models), self.probs(models), request_draw(self.seed, req, position))

    def entry(self, req, models):
        return self.writer(req, models, 0)

    def route(self, step: Step) -> str:
        return self.writer(step.request, step.models, step.position + 1)

    def send(self, req, target) -> Handoff:
        return Handoff(keep_sampled=True)
