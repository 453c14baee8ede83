"""Messages between the engine and the sub-servers, and the events of the trace.

Sub-servers share no state: everything they learn about a request arrives as one of the
messages below, and everything the engine learns comes back as an event. The engine records
the events it receives (plus `Admitted`, which it makes itself) as a call's trace: a list of
these dataclasses, read by field name by metrics, views, the planner and the benchmarks.
Per-step messages are compact: a handoff carries only the suffix the target has not seen.
Times are ``time.perf_counter()`` seconds (simulated seconds on the sim backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import RequestConfig


# ---- into a sub-server -------------------------------------------------------------------
@dataclass
class Admit:
    """A new request enters at this model (its entry model)."""

    config: RequestConfig
    t_admit: float
    state: dict = field(default_factory=dict)  # the policy state entry() started
    peers: tuple[str, ...] = ()  # models sent a `Prefill` of this request (they hold its prompt)


@dataclass
class Prefill:
    """Prefill the prompt of a request whose entry model is ``entry`` now, without routing it:
    the request then waits here (pending, KV kept) for its first handoff, which feeds only the
    tokens written since (``EngineConfig.prefill_peers``). Sent before the entry's `Admit`."""

    config: RequestConfig
    entry: str


@dataclass
class RequestState:
    """What travels with a request from model to model: the one place to add such a field (the
    scheduler's `Seq` holds it as ``request_state``; a `HandoffMsg` carries it as ``request``; the codec
    sends it field by field, the policy state and the logits pickled).

    Attributes:
        seen: per model, how many tokens of prompt + committed it has seen.
        n_committed: committed output tokens so far.
        hops, hops_since_commit: handoffs so far, and since the last committed token.
        discarded: sampled tokens dropped (discarding handoffs and resamples).
        state: the policy's per-request state (`RequestView.state`).
        span, return_to: forced span (tokens the model holding the request writes before control
            returns to ``return_to``), or None.
        greedy: decode greedily until the next handoff (`Handoff.greedy`).
        peer_logits: the handing-off model's logits [V] of the position the receiver writes next
            (a discarding handoff of a policy with ``Needs(handoff_logits=True)``), read by the
            receiver's next step only, else None.

    Models that do not share a tokenizer (the committed output is bytes; `docs/mixed-vocabularies.md`):
        seen_bytes: per model that received a handoff of it, how many committed output bytes it
            has seen (``seen`` then only says which models hold it).
        n_bytes: committed output bytes.
        units: tokens of the committed text in the unit model's vocabulary (the last model's:
            the unit of ``max_new_tokens``), as last counted; unit_at, unit_base: the count's
            stable boundary, ``unit_base`` tokens encode the first ``unit_at`` bytes
            (`tokenrouter_sdk.byte_vocab.ByteVocab.count`).
    """

    seen: dict[str, int] = field(default_factory=dict)
    n_committed: int = 0
    hops: int = 0
    hops_since_commit: int = 0
    discarded: int = 0
    state: dict = field(default_factory=dict)
    span: int | None = None
    return_to: str | None = None
    greedy: bool = False
    peer_logits: object = None  # torch.Tensor [V] or None
    seen_bytes: dict[str, int] = field(default_factory=dict)
    n_bytes: int = 0
    units: int = 0
    unit_at: int = 0
    unit_base: int = 0


@dataclass
class HandoffMsg:
    """The request now belongs to the receiving model.

    Attributes:
        rid: request id.
        src: the model that handed off.
        suffix: tokens of prompt + committed the target has not seen, shape [s].
        request: its `RequestState` (after the target applies ``suffix``,
            ``request.seen[target] == len(prompt + committed)``).
        keep_sampled: whether the source committed its sampled token.
        config: the request config, sent only on the target's first visit.
        data: models that do not share a tokenizer: the committed output bytes the target has
            not seen (``suffix`` is then empty; the target encodes them in its own tokens).
    """

    rid: int
    src: str
    suffix: list[int]
    request: RequestState
    keep_sampled: bool
    config: RequestConfig | None = None
    data: bytes = b""


@dataclass
class Release:
    """The request ended elsewhere: free its KV here."""

    rid: int


@dataclass
class Abort:
    """End the request at the next step boundary: the model that owns it (or receives it later
    in a handoff) reports ``Finished(reason)``; every model frees its KV."""

    rid: int
    reason: str = "aborted"
    error: str | None = "aborted by the user"


@dataclass
class RegisterPolicy:
    """Makes a policy known to a sub-server under ``key`` (sent before any request uses it;
    sent again when the policy changed between calls)."""

    key: int
    policy: object


@dataclass
class UnregisterPolicy:
    """No request uses the policy under ``key`` any more: drop it."""

    key: int


@dataclass
class Shutdown:
    pass


@dataclass
class ClearPrefixCache:
    """Forget every block of the prefix cache (idle cached blocks become free; blocks requests
    hold stay theirs, no longer shared). Handled in order with the other messages, so requests
    admitted after it find an empty cache."""


@dataclass
class Go:
    """Gated modes (``sync``, ``model_sync``): run at most one step now, then report."""

    round: int


@dataclass
class SetThresholds:
    """New delayed batching thresholds B_i per model."""

    thresholds: dict[str, int]


@dataclass
class SetInflight:
    """Requests in flight in the whole engine (``delayed`` mode's tail rule)."""

    n: int


@dataclass
class StatsQuery:
    """Report this sub-server's KV pool and request counts (answered with `Stats`)."""

    token: int


# ---- events: out of a sub-server (and the engine's own), recorded in the trace ----------
@dataclass
class Admitted:
    """The engine admitted request ``rid`` at ``t``; ``model`` is its entry model."""

    rid: int
    model: str
    t: float


@dataclass
class Committed:
    """Tokens committed to a request's output by ``model`` at time ``t`` (seconds); ``last``:
    the request ends with them (its `Finished` follows). ``logprobs`` (requests with
    ``SamplingParams.logprobs`` set): per token ``(logprob, ((token_id, logprob), ...))``, its
    log-probability under ``model`` and the top alternatives, most likely first. Models that
    do not share a tokenizer: ``chars``, the characters that begin in the tokens' bytes, and
    ``units``, the committed text's length in the unit model's tokens after them where it was
    counted (always on the last); None otherwise. ``stop_token``: the last token is the stop
    token id or end-of-sequence id that ended the request (it is in the output's tokens, not in
    its text)."""

    rid: int
    model: str
    tokens: list[int]
    t: float
    last: bool = False
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    chars: int | None = None
    units: int | None = None
    stop_token: bool = False


@dataclass
class Hopped:
    """``src`` handed the request to ``dst`` at ``t``; ``kept``: the sampled token was committed,
    else ``token`` is the discarded sampled token id (for views; it is in no output or KV)."""

    rid: int
    src: str
    dst: str
    kept: bool
    t: float
    token: int | None = None


@dataclass
class Retokenized:
    """Models that do not share a tokenizer: ``model`` received request ``rid`` at ``t`` and
    encoded the committed text it had not seen in its own tokens (`docs/mixed-vocabularies.md`).

    Attributes:
        refed: tokens it had in KV whose encoding changed with the new text (the KV was rewound
            before them and they are fed again).
        fed: tokens its next step feeds for the request (``refed`` + the new text's tokens).
        context: its tokens of prompt + output: what feeding it all again would cost.
    """

    rid: int
    model: str
    refed: int
    fed: int
    context: int
    t: float


@dataclass
class Resampled:
    """``model`` discarded the token it sampled for output ``position`` of request ``rid`` and
    draws that position again (a `Resample` route decision); ``token`` is in no output or KV.
    Not a hop."""

    rid: int
    model: str
    token: int
    position: int
    t: float


@dataclass
class Finished:
    """The request ended on ``model`` at ``t``: ``reason`` is eos | length | stop | aborted |
    failed; ``error`` says why for failed/aborted; ``stop_reason`` is the stop string or stop
    token id that ended it (reason ``stop``); ``undelivered``: a dead letter (`dead_letter`), the
    answer to a message ``model`` could not receive, so no sub-server freed the request's KV."""

    rid: int
    model: str
    reason: str
    error: str | None
    t: float
    stop_reason: str | int | None = None
    traceback: str | None = None
    undelivered: bool = False


@dataclass
class StepDone:
    """One forward of ``model``: timing (seconds) and what it fed.

    Attributes:
        t_start, t_end: the step's start and end; forward_s: time inside the model forward.
        batch_size: requests in the step; tokens_fed: tokens fed (prefill + decode + extend).
        fed: rid -> tokens fed this step.
        preempted: KV evictions made to schedule this step.
        round: the gated-mode round it answered, or None.
        kv_used_blocks: blocks of this model's pool in use after the step.
        queued: requests this model owned that were not in the step.
        kv_pending_blocks: block references held by requests pending here (handed off, KV kept).
        cache_hit_tokens: tokens this step's requests took from the prefix cache instead of
            feeding them; cache_query_tokens: tokens its requests brought when they arrived with
            no KV here (new, first visit, admission prefill, preempted; counted with the cache
            off too), so ``cache_query_tokens - cache_hit_tokens`` were prefilled.
        kv_cached_blocks: blocks in the prefix cache after the step (held or idle).
    """

    model: str
    t_start: float
    t_end: float
    forward_s: float
    batch_size: int
    tokens_fed: int
    fed: dict[int, int] = field(default_factory=dict)
    preempted: int = 0
    round: int | None = None
    kv_used_blocks: int = 0
    queued: int = 0
    kv_pending_blocks: int = 0
    cache_hit_tokens: int = 0
    cache_query_tokens: int = 0
    kv_cached_blocks: int = 0

    @property
    def t(self) -> float:
        return self.t_end


@dataclass
class Idle:
    """Gated modes: ``model`` had nothing to run in ``round``."""

    model: str
    round: int


@dataclass
class ModelDied:
    """The sub-server of ``model`` stopped serving (its process died or its thread raised)."""

    model: str
    error: str
    t: float = 0.0


@dataclass
class Stats:
    """Answer to `StatsQuery` ``token``: ``model``'s KV pool and the requests it holds.

    Attributes:
        free_blocks, num_blocks: blocks free / usable in the pool (free includes the idle
            cached blocks: they are evicted when space is needed); block_size: tokens per block.
        owned: requests ready to step here (waiting or running); pending: handed off, KV kept.
        running_blocks: block references held by owned requests; pending_blocks: by pending
            ones (a block shared through the prefix cache counts once per request holding it).
        alive: False when the sub-server is dead (the counts are then zero); error: why.
        prefix_cache: whether the prefix cache is on; cached_blocks: blocks in it (held by
            requests or idle); idle_cached_blocks: of which no request holds.
        prefix_hit_tokens, prefix_query_tokens: since the sub-server started, tokens taken from
            the prefix cache and tokens requests brought on arrival (``hit_rate`` is their ratio).
    """

    model: str
    token: int
    free_blocks: int
    num_blocks: int
    block_size: int
    owned: int
    pending: int
    running_blocks: int = 0
    pending_blocks: int = 0
    alive: bool = True
    error: str | None = None
    prefix_cache: bool = False
    cached_blocks: int = 0
    idle_cached_blocks: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate: tokens reused / tokens looked up (0.0 before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


EVENTS = (Admitted, Committed, Hopped, Resampled, Finished, StepDone, Retokenized)
