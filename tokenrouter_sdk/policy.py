"""The researcher's surface: `Policy` with `route` / `send` / `receive`, the per-step data it
sees (`Step`, `StepBatch`), and what travels on a handoff (`Handoff`).

A policy runs on the sub-server of the model that owns the request, after every forward of
that model (docs/architecture.md, "The life of a request"). It is plain Python and per request; per-request state lives
in ``step.state`` (a dict that travels with the request across handoffs).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .request import RequestView


@dataclass(frozen=True)
class Needs:
    """Per-step data a policy opts in to. All of it is computed lazily on the CPU torch
    backend; the flags matter for backends that must ship data across processes.

    Attributes:
        entropy: next-token entropy (nats) and normalised entropy.
        topk: number of top logits (values and indices) wanted; 0 = none.
        logits: the full last-position logits, shape [V].
        hidden: the last-layer hidden state of the position that produced the token, shape [H].
    """

    entropy: bool = False
    topk: int = 0
    logits: bool = False
    hidden: bool = False


@dataclass
class Handoff:
    """What happens to the just-sampled token when a request changes owner.

    Attributes:
        keep_sampled: True commits the token the source just sampled, then the target
            continues after it; False discards it and the target regenerates that position
            (R2R / CITER semantics).
        span: if set, the target writes exactly ``span`` tokens (without calling ``route``
            on the target) and the request then returns to the source, keeping the last one.
            ``None`` lets the target's ``route`` decide when to return.
    """

    keep_sampled: bool = False
    span: int | None = None

    @classmethod
    def default(cls, req: "RequestView | None" = None, target: str | None = None, *,
                keep_sampled: bool = False, span: int | None = None) -> "Handoff":
        return cls(keep_sampled=keep_sampled, span=span)


class StepBatch:
    """One model's forward results for the requests it owns in a step.

    Attributes:
        model: the model that ran the forward.
        models: all model names, smallest first.
        tokens: sampled token per request, shape [B] (int64).
        logits: last-position logits, shape [B, V] (float32 or the model dtype).
        hidden: last-layer hidden states (after the final norm) of those positions, shape [B, H].
        requests: the requests, length B.
        tokenizer: the shared tokenizer (for text-level rules such as step boundaries), or None.
    """

    def __init__(self, model: str, models: Sequence[str], tokens: torch.Tensor,
                 logits: torch.Tensor, hidden: torch.Tensor, requests: list["RequestView"],
                 tokenizer=None):
        self.model, self.models = model, list(models)
        self.tokens, self.logits, self.hidden, self.requests = tokens, logits, hidden, requests
        self.tokenizer = tokenizer
        self._logp: torch.Tensor | None = None
        self._entropy: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def logprobs(self) -> torch.Tensor:
        """Log-softmax of the logits, shape [B, V] (float32)."""
        if self._logp is None:
            self._logp = torch.log_softmax(self.logits.float(), dim=-1)
        return self._logp

    @property
    def entropy(self) -> torch.Tensor:
        """Shannon entropy of the next-token distribution, nats, shape [B]."""
        if self._entropy is None:
            lp = self.logprobs
            self._entropy = -(lp.exp() * lp).nan_to_num().sum(-1)
        return self._entropy

    @property
    def norm_entropy(self) -> torch.Tensor:
        """Entropy divided by log V, in [0, 1], shape [B] (R-Stitch, arXiv 2507.17307)."""
        return self.entropy / math.log(self.logits.shape[-1])

    @property
    def max_prob(self) -> torch.Tensor:
        """Probability of the most likely token, shape [B]."""
        return self.logprobs.max(-1).values.exp()

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k logit values and indices, each shape [B, k], sorted descending."""
        v, i = torch.topk(self.logits, k, dim=-1)
        return v, i

    def __getitem__(self, i: int) -> "Step":
        return Step(self, i)


class Step:
    """The view of one request at one step (a row of a `StepBatch`).

    Attributes:
        model: the model that just ran (the owner).
        token: the token just sampled (not yet committed).
        position: index of that token in the output (= tokens committed so far).
        request / req: the `RequestView`; ``state`` is its per-request dict.
    """

    __slots__ = ("batch", "i")

    def __init__(self, batch: StepBatch, i: int):
        self.batch, self.i = batch, i

    model = property(lambda self: self.batch.model)
    models = property(lambda self: self.batch.models)
    tokenizer = property(lambda self: self.batch.tokenizer)
    request = property(lambda self: self.batch.requests[self.i])
    req = request
    state = property(lambda self: self.batch.requests[self.i].state)
    token = property(lambda self: int(self.batch.tokens[self.i]))
    position = property(lambda self: self.batch.requests[self.i].n_generated)
    logits = property(lambda self: self.batch.logits[self.i])
    hidden = property(lambda self: self.batch.hidden[self.i])
    entropy = property(lambda self: float(self.batch.entropy[self.i]))
    norm_entropy = property(lambda self: float(self.batch.norm_entropy[self.i]))
    max_prob = property(lambda self: float(self.batch.max_prob[self.i]))

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k logit values and indices of this step, each shape [k]."""
        return torch.topk(self.logits, k)

    def __repr__(self) -> str:
        return f"Step(model={self.model!r}, rid={self.request.rid}, position={self.position}, token={self.token})"


def request_rng(seed, req: "RequestView") -> random.Random:
    """A `random.Random` for one request of a seeded policy: drawn from ``(seed, req.key)``, so
    the same call twice, or a prompt alone and in a batch, draws the same numbers, whatever the
    Router served before."""
    return random.Random(f"{seed}:{req.key}")


class Policy:
    """Base class of routing policies. Subclass it, in a module or a notebook cell.

    Override:
        route(step) -> str | bool: after each forward on the owning model; return the model
            that writes next (its own name to stay). With two models a bool works too:
            True hands off to the other model, False stays.
        route_batch(batch) -> list: vectorised form over a `StepBatch` (shape [B] inputs);
            the default loops over ``route``. Learned routers override this.
        send(req, target) -> Handoff: on a handoff, whether the sampled token is kept and
            how many tokens the target writes. Default: discard, target's route decides.
        receive(handoff, req): hook on the target before it runs the request (e.g. to
            set per-request state). Default: accept.
        entry(req) -> str | None: the model that prefills the request (query-level routing);
            None = the first (smallest) model.

    Errors: a policy that raises, or returns an unknown model, fails that request only,
    with an error naming the policy, the model and the position; other requests go on.
    """

    needs: Needs = Needs()

    @property
    def name(self) -> str:
        return type(self).__name__

    def entry(self, req: "RequestView", models: Sequence[str]) -> str | None:
        return None

    def route(self, step: Step) -> str | bool:
        return step.model

    def route_batch(self, batch: StepBatch) -> list[str | bool]:
        return [self.route(batch[i]) for i in range(len(batch))]

    def send(self, req: "RequestView", target: str) -> Handoff:
        return Handoff(keep_sampled=False)

    def receive(self, handoff: Handoff, req: "RequestView") -> None:
        return None

    def __repr__(self) -> str:
        attrs = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{self.name}({attrs})"
