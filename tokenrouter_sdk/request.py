"""Requests: what a user submits (`SamplingParams`), what travels with a request between
sub-servers (`RequestConfig`), what a policy sees (`RequestView`) and what comes back
(`RequestOutput`)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_new_tokens: committed output tokens at most (tokens); must be >= 1. For models that
            do not share a tokenizer, the unit is the last (largest) model's tokens of the
            committed text: the request ends once the text encodes to this many of its tokens.
        temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: per-request seed; the same seed (and the same policy decisions) gives the same
            output. ``None`` draws from fresh entropy.
        stop: strings that end generation when they appear in the output text; the text is
            cut before the stop string (which is never streamed), the tokens are kept in
            ``token_ids``; ``finish_reason == "stop"`` and ``stop_reason`` is the string.
        stop_token_ids: token ids that end generation (``finish_reason == "stop"``,
            ``stop_reason`` is the id; the token is in ``token_ids``, not in ``text``). The
            end-of-sequence ids (the tokenizer's EOS and every model's
            ``generation_config.eos_token_id``) stop a request without being listed here. Not for
            models that do not share a tokenizer (an id means a different token in each; use
            ``stop`` strings): such a request fails with an error saying so. There each model's
            own end-of-sequence ids end the request when that model writes one.
        ignore_eos: keep generating past the end-of-sequence ids (``stop_token_ids`` still stop).
        logprobs: None (default): no log-probabilities. ``k >= 0``: for every committed token its
            log-probability under the model that wrote it (natural log, from that model's
            distribution over the shared vocabulary before temperature, top-k and top-p), and
            with ``k > 0`` the ``k`` most likely tokens of that distribution
            (`RequestOutput.logprobs`, `RequestOutput.top_logprobs`).
        n: samples per prompt (each its own request, with its own key; sample ``j`` of a seeded
            request draws with ``seed + j``). ``generate`` returns the ``n`` samples of prompt
            ``i`` at positions ``i * n`` to ``i * n + n - 1``.

    Raises:
        ValueError: from :meth:`validate`, naming the bad field and the accepted range.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(
                f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}; ask for at least 1 new token"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if isinstance(self.stop_token_ids, int):
            self.stop_token_ids = (self.stop_token_ids,)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
            raise ValueError(f"logprobs must be None (off) or an int >= 0 (top alternatives per token), got {lp!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1 (samples per prompt), got {self.n!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def prompt_key(prompt_ids, occurrence: int = 0) -> int:
    """The default `RequestView.key` of a request: a stable 63-bit hash of its prompt token ids
    and of ``occurrence`` (how many identical prompts came before it in the same call)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(",".join(str(int(i)) for i in prompt_ids).encode())
    if occurrence:
        h.update(f"#{occurrence}".encode())
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass
class RequestInput:
    """One request as the engine takes it (`Engine.submit`).

    Attributes:
        prompt_ids: prompt token ids, shape [P] (None when ``error`` is set).
        params: sampling and stopping.
        prompt: the prompt as the user gave it (kept in the output).
        key: the user's key for seeded policy randomness (None: derived from the prompt).
        error: bad input found by the caller: the request ends ``failed`` with it, unrun.
        forced: output tokens given in advance (teacher forcing): output position i writes
            ``forced[i]`` instead of a sampled token, on whichever model the policy routes it to
            (its log-probability is that model's); no stop rule ends the request inside them.
            Sampling continues after them up to ``max_new_tokens`` (which counts them).
        sample: which of the ``n`` samples of its prompt this is.
        prompts: for models that do not share a tokenizer, per model its own prompt ids (the
            prompt rendered by its own chat template); ``prompt_ids`` is then the last model's.
            None for one shared tokenizer.
    """

    prompt_ids: list[int] | None
    params: SamplingParams
    prompt: Any = None
    key: int | str | None = None
    error: str | None = None
    forced: list[int] | None = None
    sample: int = 0
    prompts: dict[str, list[int]] | None = None


def token_ids(value) -> list[int]:
    """A token id setting as a list of ints: an id, a list or tuple of ids, or None (none); how
    ``eos_token_id`` of a tokenizer or a generation config is read (either form occurs)."""
    if value is None:
        return []
    return [int(i) for i in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass
class RequestConfig:
    """The immutable part of a request, sent to a sub-server on its first visit.

    Attributes:
        rid: request id, unique within one engine.
        prompt_ids: prompt token ids, shape [P].
        params: sampling and stopping.
        policy_key: which registered policy routes this request.
        eos_ids: token ids that end the request (unless ``params.ignore_eos``).
        key: the request's key for seeded policy randomness (see `RequestView.key`).
        forced: output tokens given in advance (see `RequestInput.forced`).
        prompts: per model its own prompt ids, for models that do not share a tokenizer (see
            `RequestInput.prompts`); None for one shared tokenizer.
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    policy_key: int
    eos_ids: tuple[int, ...] = ()
    key: int | str = 0
    forced: tuple[int, ...] = ()
    prompts: dict[str, list[int]] | None = None

    def prompt_of(self, model: str) -> list[int]:
        """The prompt ids ``model`` reads: its own (models without one shared tokenizer), else
        ``prompt_ids``."""
        return self.prompts[model] if self.prompts is not None else self.prompt_ids


@dataclass
class RequestView:
    """What a policy sees of a request at a step (read-only, except ``state``).

    Attributes:
        rid: request id.
        prompt_ids: prompt token ids, shape [P] (the owner's own, for models that do not share
            a tokenizer).
        output_ids: committed output token ids so far, shape [n_generated]. On a step the
            just-sampled token is *not* in it yet (it is ``step.token``). For models that do not
            share a tokenizer, the owner's own tokens of the committed text: its encoding of the
            text when it last received the request, then the tokens it wrote since.
        owner: the model writing the request now.
        state: per-request policy state (a dict the policy may fill; it travels with handoffs).
        hops: handoffs so far.
        models: all model names, smallest first.
        key: a key for per-request randomness that does not depend on how many requests the
            Router served: the user's key for the request (``generate(keys=...)``), else a
            stable hash of the prompt tokens (followed by the forced output tokens of a scored
            request, `Router.score`) and of how many identical ones came before it in the same
            call. The same call twice, or a prompt alone and in a batch, gives the
            same key. Seeded policies draw from ``(seed, key)``.
        text: the committed output as text (`RequestView.text`; computed when read).
    """

    rid: int
    prompt_ids: list[int]
    output_ids: list[int]
    owner: str
    state: dict
    hops: int
    models: tuple[str, ...] = ()
    key: int | str = 0
    text_of: Any = field(default=None, repr=False, compare=False)  # a str, or a zero-argument function giving it

    @property
    def n_generated(self) -> int:
        return len(self.output_ids)

    @property
    def text(self) -> str:
        """The committed output so far as text (special tokens skipped; a character whose bytes
        are not all committed yet shows as U+FFFD), the same text for every model whatever its
        tokenizer; "" where the caller gave none."""
        t = self.text_of
        if callable(t):
            t = self.text_of = t()
        return t or ""


@dataclass
class RequestOutput:
    """One finished request.

    Attributes:
        rid: request id.
        prompt: the prompt as given (text or token ids).
        text: the decoded committed output, cut before a stop string.
        token_ids: committed output token ids, shape [n]. For models that do not share a
            tokenizer, each id is in the vocabulary of the model that wrote it
            (``token_models[i]``): the ids as each writer sampled them, in order; their bytes
            joined are the text (before a stop string cut), while ``text`` is primary.
        token_models: for each committed token, the name of the model that wrote it, shape [n].
        finish_reason: ``"eos"``, ``"length"`` (max_new_tokens or context), ``"stop"``,
            ``"aborted"`` or ``"failed"``.
        stop_reason: the stop string or stop token id that ended it (``"stop"``), else None.
        error: why the request failed or was aborted (None otherwise).
        traceback: the formatted traceback of a policy error that failed it, else None.
        index: the request's position in its call.
        hops: handoffs between models, both directions, including those after which the
            target committed nothing (see ``writer_changes``).
        discarded: sampled tokens dropped on a handoff (never in ``token_ids``).
        discarded_log: each dropped token as ``(position, token_id, model)``: it was sampled by
            ``model`` for output position ``position`` (an index into ``token_ids``), and the
            peer wrote that position instead. For views only (``RunResult.show``).
        ttft_s: seconds from admission to the first committed token (None if none).
        latency_s: seconds from admission to the end.
        key: the request's key (`RequestView.key`): the user's, else derived from the prompt.
        sample: which of the ``n`` samples of its prompt this is (0 with ``n=1``).
        logprobs: with ``SamplingParams.logprobs`` set, per committed token its log-probability
            under the model that wrote it (``token_models[i]``), shape [n]; else None.
        top_logprobs: with ``logprobs=k > 0``, per committed token the k most likely tokens of
            the writer's distribution as ``{token_id: logprob}`` (most likely first); else None.
    """

    rid: int
    prompt: Any
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_models: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    traceback: str | None = None
    index: int = 0
    hops: int = 0
    discarded: int = 0
    discarded_log: list[tuple[int, int, str]] = field(default_factory=list)
    ttft_s: float | None = None
    latency_s: float | None = None
    key: int | str | None = None
    sample: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason not in ("failed", "aborted", None)

    @property
    def writer_changes(self) -> int:
        """Committed positions written by another model than the position before (at most
        ``hops``: a handoff after which the target commits nothing changes no writer)."""
        m = self.token_models
        return sum(a != b for a, b in zip(m, m[1:]))

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
