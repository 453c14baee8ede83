"""Query-level routing: one model writes the whole answer, chosen once per request from the
prompt (RouteLLM, arXiv 2406.18665, lm-sys/RouteLLM ``routellm/routers/routers.py``).

RouteLLM routes to the strong model iff its predicted strong-win-rate >= threshold, from a prompt
embedding (OpenAI embeddings, BERT, an LLM judge). Offline here, the feature is the small
model's own last-layer hidden state (after the final norm) from its prefill, so the decision
costs one head evaluation and no extra model: ``pooling="last"`` (default) takes h at the last
prompt token; ``pooling="mean"`` the mean of h over every prompt position, a pooled prompt
embedding like RouteLLM's (the prefill keeps every position's state for these requests only,
``Needs(prompt_hidden=True)``). A head is trained for one pooling: pass the one it was trained on.

`QueryRouter`: the request enters on the small model S; at S's first step (position 0) a head
predicts p = P(S answers correctly | h). p < threshold -> S's token is discarded and the large
model L writes the whole answer (including position 0); else S writes it all. Cost of the L
branch: one S prefill and one discarded token.

`RandomQueryRouting`: with probability p per request L writes everything; decided in
``entry()``, so an L request is prefilled on L only (no S work at all).

Head file: the shared format of ``policies/heads.py`` (kind ``"query"``; ``config`` =
``{"hidden_size", "hidden_dim", "threshold"?}``), read with ``torch.load(weights_only=True)``.
Training (which prompts S answers correctly -> logistic regression / MLP):
``tokenrouter_sdk.train.train_query`` (CLI ``tokenrouter train query``). Without a head, the one
packaged for ``pair`` is loaded (``tokenrouter_sdk/assets/<pair>_query_head.pt``; its record is
the ``.json`` beside it) with its stored threshold, the quantile of p over its training prompts
that sends a share of them to the large model: about 0.25 for ``smollm2`` (labels: agreement
with the large model's answer; measured on the 128 held-out GSM8K questions: the record's
``heldout`` section), 0.3 for ``qwen2.5-coder`` (labels: the small model's answer is right).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenrouter_sdk.policy import Handoff, Needs, Policy, Step, StepBatch, request_draw

from .heads import HeadRecord, check_hidden, packaged_head_path, resolve_head, save_head


class QueryHead(nn.Module):
    """p = sigmoid(f((h - mu) / sigma)): logistic regression (``hidden_dim=0``, f = Linear) or a
    one-hidden-layer MLP (f = Linear-ReLU-Linear). h: [B, H] -> p: [B] (float32)."""

    def __init__(self, hidden_size: int, hidden_dim: int = 0):
        super().__init__()
        self.config = {"hidden_size": hidden_size, "hidden_dim": hidden_dim}
        self.register_buffer("mu", torch.zeros(hidden_size))
        self.register_buffer("sigma", torch.ones(hidden_size))
        self.net = (
            nn.Linear(hidden_size, 1)
            if hidden_dim == 0
            else nn.Sequential(nn.Linear(hidden_size, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 1))
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        check_hidden("query", self.config["hidden_size"], h.shape[-1])
        x = (h.to(self.mu.device, torch.float32) - self.mu) / self.sigma
        return torch.sigmoid(self.net(x)).squeeze(-1)


def save_query_head(head: QueryHead, path, meta: dict | None = None) -> None:
    """Write ``head`` as a head file of kind ``"query"``."""
    save_head(path, "query", head.state_dict(), head.config, meta)


def load_query_head(head) -> QueryHead:
    """A `QueryHead` from a head file path or a `QueryHead`; HeadMissingError if there is none."""
    if isinstance(head, QueryHead):
        return head
    return _query_head(head)[0]


def _query_head(head, pair: str | None = None) -> tuple[QueryHead, dict, dict]:
    """(head, its file's config, its file's meta) from a path, None (the packaged head of
    ``pair``) or a `QueryHead`."""
    if isinstance(head, QueryHead):
        return head, {}, {}
    sd, config, meta = resolve_head(head, "query", pair=pair)
    q = QueryHead(**{k: config[k] for k in ("hidden_size", "hidden_dim") if k in config})
    q.load_state_dict(sd)
    return q.eval().requires_grad_(False), config, meta


class QueryRouter(HeadRecord, Policy):
    """Args:
        head: a head file (see the module docstring) or a `QueryHead`; None (default) = the head
            packaged for ``pair`` (hidden size 576 for ``smollm2``, 896 for ``qwen2.5-coder``;
            another pair fails at its first step with an error naming the fix: train one with
            ``tokenrouter train query``). A missing file raises `HeadMissingError`.
        threshold: L writes the answer when p = P(S correct) < threshold (RouteLLM calibrates it
            as a quantile of the router's scores for a target share of L requests). None
            (default): the threshold stored in the head file (the packaged head's sends about
            0.25 of the prompts to the large model), else 0.5.
        pooling: the prompt feature: ``"last"`` (h at the last prompt token, default; the packaged
            head's) or ``"mean"`` (h averaged over every prompt position).
        small, large: model names (default: first and last model).
        pair: with ``head=None``, the named pair whose packaged head to load (``"smollm2"``,
            the default, or ``"qwen2.5-coder"``).

    Per-request state: ``p_small`` (the head's p, set at position 0 on S).

    Raises:
        ValueError: an unknown ``pooling``.
    """

    POOLINGS = ("last", "mean")

    @property
    def needs(self) -> Needs:
        return Needs(hidden=True) if self.pooling == "last" else Needs(prompt_hidden=True)

    def __init__(
        self,
        head: str | os.PathLike | QueryHead | None = None,
        threshold: float | None = None,
        small: str | None = None,
        large: str | None = None,
        pooling: str = "last",
        pair: str | None = None,
    ):
        if pooling not in self.POOLINGS:
            raise ValueError(f"QueryRouter: pooling must be one of {self.POOLINGS}, got {pooling!r}")
        if head is not None and pair is not None and not isinstance(head, QueryHead):
            raise ValueError("QueryRouter: give head=<a file> or pair=<a packaged pair>, not both")
        self._head, config, self._head_meta = _query_head(head, pair)
        self.head = (
            "<in memory>"
            if isinstance(head, QueryHead)
            else str(packaged_head_path("query", pair))
            if head is None
            else str(head)
        )
        if threshold is None:
            threshold = config.get("threshold", 0.5)
        self.threshold, self.small, self.large = threshold, small, large
        self.pooling = pooling

    def features(self, batch: StepBatch, rows: list[int]) -> torch.Tensor:
        """The prompt feature of each request at ``rows`` of a first step, shape [len(rows), H].

        Raises:
            ValueError: ``pooling="mean"`` on a backend that gives no prompt hidden states.
        """
        if self.pooling == "last":
            return batch.hidden[rows]
        ph = batch.prompt_hidden
        missing = [batch.requests[i].rid for i in rows if ph[i] is None]
        if missing:
            raise ValueError(
                f"QueryRouter(pooling='mean'): no prompt hidden states for requests {missing} (this "
                f"backend's runner gives none); use pooling='last'"
            )
        return torch.stack([ph[i].mean(0) for i in rows])

    @staticmethod
    def random_head(hidden_size: int, seed: int = 0, hidden_dim: int = 0) -> QueryHead:
        """An untrained head with seeded random weights (for tests)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return QueryHead(hidden_size, hidden_dim).eval().requires_grad_(False)

    def route_batch(self, batch: StepBatch) -> list[str]:
        small, large = self.small or batch.models[0], self.large or batch.models[-1]
        out = [batch.model] * len(batch)
        rows = [i for i, r in enumerate(batch.requests) if batch.model == small and r.n_generated == 0]
        if rows:
            with torch.inference_mode():
                p = self._head(self.features(batch, rows)).tolist()
            for i, pi in zip(rows, p):
                batch.requests[i].state["p_small"] = pi
                if pi < self.threshold:
                    out[i] = large
        return out

    def route(self, step: Step) -> str:
        return self.route_batch(step.batch.select([step.i]))[0]

    def send(self, req, target) -> Handoff:
        return Handoff(keep_sampled=False)  # L regenerates position 0 and keeps the request


class RandomQueryRouting(Policy):
    """Per request, with probability ``p`` the large model prefills and writes everything,
    else the small one does (RouteLLM's ``random`` router). Draws from
    `request_draw` ``(seed, request, 0)``, like `RandomRouting`.

    Args:
        p: share of requests sent to the large model, in [0, 1].
        seed: base seed.
        small, large: model names (default: first and last model).
    """

    def __init__(self, p: float = 0.5, seed: int = 0, small: str | None = None, large: str | None = None):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomQueryRouting: p must be in [0, 1], got {p}")
        self.p, self.seed, self.small, self.large = p, seed, small, large

    def entry(self, req, models):
        to_large = request_draw(self.seed, req, 0) < self.p
        return (self.large or models[-1]) if to_large else (self.small or models[0])

    def may_use(self, req, models):
        return [req.owner]  # the model entry() chose writes everything

    def route(self, step: Step) -> str:
        return step.model
