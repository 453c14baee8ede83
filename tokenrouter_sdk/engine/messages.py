"""Messages between the engine and the sub-servers. Sub-servers share no state: everything
they learn about a request arrives as one of these. Per-step messages are compact: a handoff
carries only the suffix the target has not seen, never the whole history."""

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


@dataclass
class HandoffMsg:
    """The request now belongs to the receiving model.

    Attributes:
        rid: request id.
        src: the model that handed off.
        suffix: tokens of prompt + committed the target has not seen, shape [s].
        seen: per model, how many tokens of prompt + committed it has seen (after the
            target applies ``suffix``, ``seen[target] == len(prompt + committed)``).
        n_committed: committed output tokens so far.
        hops, hops_since_commit, discarded: counters.
        state: the policy's per-request state.
        span, return_to: forced span (tokens the target writes before control returns to
            ``return_to``), or None.
        keep_sampled: whether the source committed its sampled token.
        config: the request config, sent only on the target's first visit.
    """

    rid: int
    src: str
    suffix: list[int]
    seen: dict[str, int]
    n_committed: int
    hops: int
    hops_since_commit: int
    discarded: int
    state: dict
    span: int | None
    return_to: str | None
    keep_sampled: bool
    config: RequestConfig | None = None


@dataclass
class Release:
    """The request ended elsewhere: free its KV here."""

    rid: int


@dataclass
class Abort:
    """Abort the request if this model owns it; free its KV either way."""

    rid: int
    reason: str = "aborted by the user"


@dataclass
class Shutdown:
    pass


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


# ---- out of a sub-server (to the engine) -----------------------------------------------
@dataclass
class Committed:
    """Tokens committed to a request's output by ``model`` at time ``t`` (seconds)."""

    rid: int
    model: str
    tokens: list[int]
    t: float


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
class Finished:
    """The request ended: reason is eos | length | stop | aborted | failed."""

    rid: int
    model: str
    reason: str
    error: str | None
    t: float
    text_cut: int | None = None  # chars of the decoded output to keep (stop strings)


@dataclass
class StepDone:
    """One forward of ``model``: timing (seconds) and what it fed."""

    model: str
    t_start: float
    t_end: float
    forward_s: float
    batch_size: int
    tokens_fed: int
    fed: dict[int, int] = field(default_factory=dict)  # rid -> tokens fed this step
    preempted: int = 0
    round: int | None = None


@dataclass
class Idle:
    """Gated modes: ``model`` had nothing to run in ``round``."""

    model: str
    round: int


@dataclass
class Stats:
    """Answer to `StatsQuery` ``token``: ``model``'s KV pool (blocks free / usable, block size)
    and the requests it holds (``owned``: ready to step here; ``pending``: handed off, KV kept)."""

    model: str
    token: int
    free_blocks: int
    num_blocks: int
    block_size: int
    owned: int
    pending: int
