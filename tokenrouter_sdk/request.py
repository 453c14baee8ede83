"""Requests: what a user submits (`SamplingParams`), what travels with a request between
sub-servers (`RequestConfig`), what a policy sees (`RequestView`) and what comes back
(`RequestOutput`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_new_tokens: committed output tokens at most (tokens); must be >= 1.
        temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: per-request seed; the same seed (and the same policy decisions) gives the same
            output. ``None`` draws from fresh entropy.
        stop: strings that end generation when they appear in the output text; the text is
            cut before the stop string, the tokens are kept in ``token_ids``.
        ignore_eos: keep generating past the end-of-sequence token.

    Raises:
        ValueError: from :meth:`validate`, naming the bad field and the accepted range.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}; "
                             "ask for at least 1 new token")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestConfig:
    """The immutable part of a request, sent to a sub-server on its first visit.

    Attributes:
        rid: request id, unique within one engine.
        prompt_ids: prompt token ids, shape [P].
        params: sampling and stopping.
        policy_key: which registered policy routes this request.
        eos_ids: token ids that end the request (unless ``params.ignore_eos``).
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    policy_key: int
    eos_ids: tuple[int, ...] = ()


@dataclass
class RequestView:
    """What a policy sees of a request at a step (read-only, except ``state``).

    Attributes:
        rid: request id.
        prompt_ids: prompt token ids, shape [P].
        output_ids: committed output token ids so far, shape [n_generated]. On a step the
            just-sampled token is *not* in it yet (it is ``step.token``).
        owner: the model writing the request now.
        state: per-request policy state (a dict the policy may fill; it travels with handoffs).
        hops: handoffs so far.
        models: all model names, smallest first.
    """

    rid: int
    prompt_ids: list[int]
    output_ids: list[int]
    owner: str
    state: dict
    hops: int
    models: tuple[str, ...] = ()

    @property
    def n_generated(self) -> int:
        return len(self.output_ids)


@dataclass
class RequestOutput:
    """One finished request.

    Attributes:
        rid: request id.
        prompt: the prompt as given (text or token ids).
        text: the decoded committed output, cut before a stop string.
        token_ids: committed output token ids, shape [n].
        token_models: for each committed token, the name of the model that wrote it, shape [n].
        finish_reason: ``"eos"``, ``"length"`` (max_new_tokens or context), ``"stop"``,
            ``"aborted"`` or ``"failed"``.
        error: why the request failed (``None`` unless ``finish_reason == "failed"``).
        hops: handoffs between models.
        discarded: sampled tokens dropped on a handoff (never in ``token_ids``).
        discarded_log: each dropped token as ``(position, token_id, model)``: it was sampled by
            ``model`` for output position ``position`` (an index into ``token_ids``), and the
            peer wrote that position instead. For views only (``RunResult.show``).
        ttft_s: seconds from admission to the first committed token (None if none).
        latency_s: seconds from admission to the end.
    """

    rid: int
    prompt: Any
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_models: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    hops: int = 0
    discarded: int = 0
    discarded_log: list[tuple[int, int, str]] = field(default_factory=list)
    ttft_s: float | None = None
    latency_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason not in ("failed", "aborted", None)

    def raise_for_error(self) -> "RequestOutput":
        """Raise ``RuntimeError`` with the request's own error if it failed; else return self."""
        if self.finish_reason == "failed":
            raise RuntimeError(f"request {self.rid} failed: {self.error}")
        return self

    def segments(self) -> list[tuple[str, list[int]]]:
        """Consecutive runs of tokens written by one model: ``[(model, [ids...]), ...]``."""
        out: list[tuple[str, list[int]]] = []
        for tok, m in zip(self.token_ids, self.token_models):
            if out and out[-1][0] == m:
                out[-1][1].append(tok)
            else:
                out.append((m, [tok]))
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
