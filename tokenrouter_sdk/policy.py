"""The researcher's surface: `Policy` with `route` / `send` / `receive`, the per-step data it
sees (`Step`, `StepBatch`), and what travels on a handoff (`Handoff`).

Hooks beyond "who writes next" (each checked against the naive reference,
`tokenrouter_sdk.reference`):
  - ``Handoff(greedy=True)``: the target decodes greedily while it holds the request (e.g. one
    greedy peer token, CITER / Co-LLM), whatever the request's sampling.
  - ``Needs(handoff_logits=True)`` + `Step.peer_logits` + `Step.set_token`: the source's
    next-token logits travel with a handoff that discards its token, and the target may write
    any token it computes from both models (Co-LLM's composed decoding).
  - `Resample` as a route decision: discard the sampled token and draw that position again on
    the same model (GlimpRouter's regenerated glimpse).
  - ``Needs(prompt_hidden=True)`` + `Step.prompt_hidden`: the last-layer hidden states of every
    prompt position at the request's first step (pooled query-level features).
  - `Policy.may_use`: the models a request may visit (with ``EngineConfig.prefill_peers`` they
    prefill its prompt at admission, so a first handoff feeds only the unseen suffix).

A policy runs on the sub-server of the model that owns the request, after every forward of
that model (docs/architecture.md, "The life of a request"). It is plain Python and per request; per-request state lives
in ``step.state`` (a dict that travels with the request across handoffs).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .request import RequestView


@dataclass(frozen=True)
class Needs:
    """Per-step data a policy opts in to: what must be kept for it or travel with a request.
    What a step computes from its own logits (the logits and log-probabilities, entropy,
    normalised entropy, max probability, top-k) is there for every policy, computed when a
    policy first reads it in that step, once per step, so a step whose policy reads none of it
    pays nothing. Reading data of a flag not declared (``hidden``, ``handoff_logits``,
    ``prompt_hidden``) raises `NeedsError` naming the flag to set. The sampled token, the
    request (`RequestView`) and its state are always there.

    Attributes:
        entropy: accepted for older policies (entropy, normalised entropy and max probability
            are computed when read).
        topk: the largest k the policy reads: the first `StepBatch.topk` call of a step takes
            the top max(k, topk) once, so smaller reads share it (a larger k is computed when
            read); 0 = the k asked.
        logits: accepted for older policies (the last-position logits [V] and log-probabilities
            are there when read).
        hidden: the last-layer hidden state of the position that produced the token, shape [H].
        handoff_logits: a handoff that discards the sampled token (``keep_sampled=False``)
            carries the source's logits of that position (shape [V], ~4 bytes x V on the wire),
            and the target's first step after it reads them as `Step.peer_logits` (Co-LLM's
            composed decoding). Off: handoffs carry no logits.
        prompt_hidden: the request's first step (output position 0 on its entry model) gives
            the last-layer hidden states of every prompt position, shape [P, H]
            (`Step.prompt_hidden`; pooled query-level features). The prefill keeps them only
            for requests of a policy that asks.
    """

    entropy: bool = False
    topk: int = 0
    logits: bool = False
    hidden: bool = False
    handoff_logits: bool = False
    prompt_hidden: bool = False


class NeedsError(RuntimeError):
    """A policy read per-step data it did not declare in its ``needs``."""


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
        greedy: the target decodes greedily (argmax) from this handoff until it hands the
            request off again (with ``span``: exactly the span's tokens), whatever the
            request's sampling parameters; its sampling generator is not advanced meanwhile.
            CITER (arXiv 2502.01976) and Co-LLM (arXiv 2403.03870) have the large model write
            one greedy token.
    """

    keep_sampled: bool = False
    span: int | None = None
    greedy: bool = False

    def __post_init__(self):
        self.check()

    def check(self) -> "Handoff":
        """Check the fields (after construction, and again where the engine receives the
        handoff: they may be changed after it was built); an integral ``span`` becomes an int.

        Raises:
            TypeError: ``keep_sampled`` or ``greedy`` not a bool, ``span`` not None or an int.
            ValueError: ``span < 1``.
        """
        for name in ("keep_sampled", "greedy"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"Handoff.{name} must be a bool, got {v!r} ({type(v).__name__})")
        if self.span is not None:
            if isinstance(self.span, bool) or not isinstance(self.span, numbers.Integral):
                raise TypeError(
                    f"Handoff.span must be None or an int >= 1 (tokens the target writes before the "
                    f"request returns), got {self.span!r} ({type(self.span).__name__})"
                )
            if self.span < 1:
                raise ValueError(f"Handoff.span must be >= 1 or None, got {int(self.span)}")
            self.span = int(self.span)
        return self

    @classmethod
    def default(
        cls,
        req: "RequestView | None" = None,
        target: str | None = None,
        *,
        keep_sampled: bool = False,
        span: int | None = None,
        greedy: bool = False,
    ) -> "Handoff":
        return cls(keep_sampled=keep_sampled, span=span, greedy=greedy)


class Resample:
    """A route decision: discard the token just sampled and draw that output position again on
    the same model, from the same next-token distribution (no new forward; with greedy decoding
    the same token comes back). ``route`` then runs again on the new token, so a policy that
    resamples must remember it did (in ``step.state``). Counts as a discarded token (in
    ``RequestOutput.discarded`` and ``discarded_log``), not as a hop. At most
    ``EngineConfig.max_hops_without_commit`` resamples in a row, else the request fails.

    Example (GlimpRouter's regenerated glimpse, arXiv 2601.05110)::

        def route(self, step):
            if not step.state.get("redrawn"):
                step.state["redrawn"] = True
                return Resample()
            ...
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "Resample()"

    def __eq__(self, other) -> bool:
        return isinstance(other, Resample)

    def __hash__(self) -> int:
        return hash(Resample)


class TopK(tuple):
    """The top-k tokens of a step (`StepBatch.topk`, `Step.topk`): unpacks as ``(logits,
    indices)``, sorted most likely first, and gives their probabilities.

    Attributes:
        logits: the top-k logit values, shape [B, k] (a `Step`'s: [k]).
        indices: their token ids, same shape (int64).
        probs: their probabilities under the softmax of all V logits (temperature 1, the
            distribution `Step.max_prob` and `Step.entropy` describe), same shape (float32).
        logprobs: their log-probabilities, same shape (float32).
    """

    def __new__(cls, logits: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor):
        self = super().__new__(cls, (logits, indices))
        self._lse = lse  # log-sum-exp of all V logits of each row, shape [B] (a Step's: scalar)
        return self

    logits = property(lambda self: self[0])
    indices = property(lambda self: self[1])

    @property
    def logprobs(self) -> torch.Tensor:
        return self[0].float() - self._lse.unsqueeze(-1) if self._lse.dim() else self[0].float() - self._lse

    @property
    def probs(self) -> torch.Tensor:
        return self.logprobs.exp()

    def __repr__(self) -> str:
        return f"TopK(indices={self[1].tolist()}, probs={[round(p, 4) for p in self.probs.flatten().tolist()]})"


class StepBatch:
    """One model's forward results for the requests it owns in a step (those of one policy).

    Attributes:
        model: the model that ran the forward.
        models: all model names, smallest first.
        tokens: sampled token per request, shape [B] (int64).
        requests: the requests, length B.
        tokenizer: the shared tokenizer (for text-level rules such as step boundaries), or None.
        needs: what the policy declared (None: everything may be read, e.g. in the reference).
        logits: last-position logits, shape [B, V] (with ``logprobs``, ``entropy``, ``norm_entropy``,
            ``max_prob`` and ``topk(k)``: computed when read, once per step).
        hidden: last-layer hidden states (after the final norm) of those positions, shape [B, H]
            (``Needs(hidden=True)``).
        peer_logits: per request, the logits [V] the handing-off model had for the position
            this model now writes, or None (``Needs(handoff_logits=True)``).
        prompt_hidden: per request, the hidden states of every prompt position [P, H] at its
            first step, or None (``Needs(prompt_hidden=True)``).

    A policy may change the token written at a position with `set_token` (then ``tokens``
    holds it): it is committed when the request stays, or kept on a handoff with
    ``keep_sampled=True``.

    Raises:
        NeedsError: on reading data ``needs`` does not declare (names the flag to set).
    """

    def __init__(
        self,
        model: str,
        models: Sequence[str],
        tokens: torch.Tensor,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        requests: list["RequestView"],
        tokenizer=None,
        needs: Needs | None = None,
        rows: torch.Tensor | None = None,
        policy: str = "",
        topk_cache: dict | None = None,
        peer_logits: Sequence[torch.Tensor | None] | None = None,
        prompt_hidden: Sequence[torch.Tensor | None] | None = None,
    ):
        self.model, self.models = model, list(models)
        self.tokens, self.requests, self.tokenizer = tokens, requests, tokenizer
        self.needs, self.policy = needs, policy
        self._logits_all, self._hidden_all, self._rows = logits, hidden, rows
        self._logits: torch.Tensor | None = None
        self._hidden: torch.Tensor | None = None
        self._logp: torch.Tensor | None = None
        self._entropy: torch.Tensor | None = None
        self._max_prob: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None
        self._topk: dict = topk_cache if topk_cache is not None else {}
        n = len(requests)
        self._peer = list(peer_logits) if peer_logits is not None else [None] * n
        self._prompt_hidden = list(prompt_hidden) if prompt_hidden is not None else [None] * n
        self._parent: tuple["StepBatch", list[int]] | None = None  # a `select`ed view writes through
        self._tokens_owned = False

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def tokens_changed(self) -> bool:
        """Whether `set_token` wrote a token into this batch (then ``tokens`` is the batch's own
        copy, holding the written tokens; the tensor it was built with is unchanged)."""
        return self._tokens_owned

    def _require(self, ok: bool, what: str, flag: str) -> None:
        if self.needs is not None and not ok:
            who = self.policy or "the policy"
            raise NeedsError(
                f"{who} reads {what} but its needs = {self.needs!r} does not declare it: set "
                f"needs = Needs({flag}) on the policy (a class attribute, or self.needs in "
                f"__init__), so the step computes it"
            )

    def _rows_of(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._rows is None else t[self._rows]

    @property
    def logits(self) -> torch.Tensor:
        """Last-position logits, shape [B, V] (this step's own: a view, no copy for the whole batch)."""
        return self._raw_logits()

    def _raw_logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self._rows_of(self._logits_all)
        return self._logits

    @property
    def hidden(self) -> torch.Tensor:
        """Last-layer hidden states, shape [B, H]."""
        self._require(self.needs is None or self.needs.hidden, "step.hidden", "hidden=True")
        if self._hidden is None:
            if self._hidden_all is None:
                raise NeedsError("this backend gives no hidden states")
            self._hidden = self._rows_of(self._hidden_all)
        return self._hidden

    @property
    def logprobs(self) -> torch.Tensor:
        """Log-softmax of the logits, shape [B, V] (float32; computed once per step when read)."""
        return self._log_softmax()

    def _log_softmax(self) -> torch.Tensor:
        if self._logp is None:
            self._logp = torch.log_softmax(self._raw_logits().float(), dim=-1)
        return self._logp

    @property
    def entropy(self) -> torch.Tensor:
        """Shannon entropy of the next-token distribution, nats, shape [B] (computed once per
        step when read)."""
        if self._entropy is None:
            lp = self._log_softmax()
            self._entropy = -(lp.exp() * lp).nan_to_num().sum(-1)
        return self._entropy

    @property
    def norm_entropy(self) -> torch.Tensor:
        """Entropy divided by log V, in [0, 1], shape [B] (R-Stitch, arXiv 2507.17307)."""
        return self.entropy / math.log(self._logits_all.shape[-1])

    @property
    def max_prob(self) -> torch.Tensor:
        """Probability of the most likely token, shape [B] (computed once per step when read)."""
        if self._max_prob is None:
            self._max_prob = self._log_softmax().amax(-1).exp()
        return self._max_prob

    def topk(self, k: int) -> TopK:
        """The top-k tokens per request: a `TopK` that unpacks as ``(logits, indices)``, each shape
        [B, k], sorted descending, with ``.probs`` / ``.logprobs`` (softmax over all V logits);
        computed when read, once per step for the largest k read or declared (``Needs(topk=)``).

        Raises:
            ValueError: ``k`` is not an int >= 1."""
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"step.topk(k): k must be an int >= 1 (how many tokens), got {k!r}")
        k = min(int(k), self._logits_all.shape[-1])
        hit = next((kk for kk in sorted(self._topk) if kk >= k), None)
        if hit is None:
            kk = max(k, self.needs.topk if self.needs is not None else 0)
            kk = min(kk, self._logits_all.shape[-1])
            self._topk[kk] = torch.topk(self._raw_logits(), kk, dim=-1)
            hit = kk
        v, i = self._topk[hit]
        if self._lse is None:  # log-sum-exp of each row: from the log-softmax when a read made it
            self._lse = (
                v[:, 0].float() - self._logp.gather(-1, i[:, :1]).squeeze(-1)
                if self._logp is not None
                else torch.logsumexp(self._raw_logits().float(), dim=-1)
            )
        return TopK(v[:, :k], i[:, :k], self._lse)

    @property
    def peer_logits(self) -> list[torch.Tensor | None]:
        """Per request, the logits [V] of the model that handed it here by discarding its token
        (the distribution it sampled this position from), else None; length B."""
        self._require(self.needs is None or self.needs.handoff_logits, "step.peer_logits", "handoff_logits=True")
        return list(self._peer)

    @property
    def peer_logprobs(self) -> list[torch.Tensor | None]:
        """Log-softmax (float32) of `peer_logits`, per request [V] or None; length B."""
        return [None if x is None else torch.log_softmax(x.float(), -1) for x in self.peer_logits]

    @property
    def prompt_hidden(self) -> list[torch.Tensor | None]:
        """Per request, the last-layer hidden states (after the final norm) of every prompt
        position, shape [P, H], at its first step (output position 0 on its entry model), else
        None; length B."""
        self._require(self.needs is None or self.needs.prompt_hidden, "step.prompt_hidden", "prompt_hidden=True")
        return list(self._prompt_hidden)

    def set_token(self, i: int, token: int) -> None:
        """Write ``token`` (an id in [0, V)) at request ``i``'s position instead of the sampled
        one: it is what a stay commits and what a handoff with ``keep_sampled=True`` keeps (with
        ``keep_sampled=False`` it is discarded like a sampled token).

        Raises:
            ValueError: ``token`` outside the vocabulary [0, V).
        """
        v = self._logits_all.shape[-1]
        token = int(token)
        if not 0 <= token < v:
            raise ValueError(f"set_token: token id {token} is outside the vocabulary [0, {v})")
        if not self._tokens_owned:  # never write into the caller's tensor
            self.tokens, self._tokens_owned = self.tokens.clone(), True
        self.tokens[i] = token
        if self._parent is not None:
            parent, idx = self._parent
            parent.set_token(idx[i], token)

    def select(self, rows: Sequence[int]) -> "StepBatch":
        """The sub-batch of ``rows`` (same needs); `set_token` on it writes through to this batch."""
        rows = list(rows)
        idx = torch.as_tensor(rows, dtype=torch.long)
        base = idx if self._rows is None else self._rows[idx]
        sub = StepBatch(
            self.model,
            self.models,
            self.tokens[idx],
            self._logits_all,
            self._hidden_all,
            [self.requests[i] for i in rows],
            self.tokenizer,
            self.needs,
            base,
            self.policy,
            peer_logits=[self._peer[i] for i in rows],
            prompt_hidden=[self._prompt_hidden[i] for i in rows],
        )
        sub._parent = (self, rows)
        return sub

    def __getitem__(self, i: int) -> "Step":
        return Step(self, i)


class Step:
    """The view of one request at one step (a row of a `StepBatch`).

    Attributes:
        model: the model that just ran (the owner); models: all model names, smallest first.
        token: the token just sampled (not yet committed), in the owning model's vocabulary.
        text: the committed output so far as text (`RequestView.text`).
        position: index of that token in the output (= tokens committed so far).
        request / req: the `RequestView` (the same object under both names): ``rid``,
            ``prompt_ids``, ``output_ids`` (committed so far), ``owner``, ``hops``, ``models``
            and ``key``, a per-request key for seeded randomness that is the same whatever
            else the Router served (`request_draw` ``(seed, step.request, i)``).
        state: the request's per-request dict (``step.request.state``); it travels with
            handoffs.
        entropy, norm_entropy, max_prob: of the next-token distribution (computed when read).
        topk(k): the k most likely tokens with their logits and probabilities (a `TopK`,
            computed when read).
        logits, logprobs: shape [V] (this step's own, when read); hidden: shape [H]
            (``Needs(hidden=True)``).
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
    text = property(
        lambda self: self.batch.requests[self.i].text,
        doc="The committed output so far as text (the same for every model, whatever its tokenizer).",
    )
    position = property(lambda self: self.batch.requests[self.i].n_generated)
    logits = property(lambda self: self.batch.logits[self.i])
    logprobs = property(lambda self: self.batch.logprobs[self.i])
    hidden = property(lambda self: self.batch.hidden[self.i])
    entropy = property(lambda self: float(self.batch.entropy[self.i]))
    norm_entropy = property(lambda self: float(self.batch.norm_entropy[self.i]))
    max_prob = property(lambda self: float(self.batch.max_prob[self.i]))

    peer_logits = property(
        lambda self: self.batch.peer_logits[self.i],
        doc="The handing-off model's logits [V] for this position, or None.",
    )
    peer_logprobs = property(
        lambda self: self.batch.peer_logprobs[self.i], doc="Log-softmax (float32) of `peer_logits`, or None."
    )
    prompt_hidden = property(
        lambda self: self.batch.prompt_hidden[self.i],
        doc="Hidden states of every prompt position [P, H] at the first step, or None.",
    )

    def set_token(self, token: int) -> None:
        """Write ``token`` at this position instead of the sampled one (see `StepBatch.set_token`)."""
        self.batch.set_token(self.i, token)

    def topk(self, k: int) -> TopK:
        """The top-k tokens of this step: a `TopK` that unpacks as ``(logits, indices)``, each
        shape [k], most likely first; ``.probs`` gives their probabilities (softmax over all V
        logits), e.g. ``step.topk(2).probs[1]`` is the runner-up's (computed when read)."""
        t = self.batch.topk(k)
        return TopK(t[0][self.i], t[1][self.i], t._lse[self.i])

    def __repr__(self) -> str:
        return f"Step(model={self.model!r}, rid={self.request.rid}, position={self.position}, token={self.token})"


def request_draw(seed, req: "RequestView", index: int) -> float:
    """A uniform draw in [0, 1) for draw ``index`` (e.g. an output position) of one request of a
    seeded policy: a hash of ``(seed, req.key, index)``. Stateless, so nothing travels with a
    handoff, and reproducible: the same call twice, or a prompt alone and in a batch, draws the
    same numbers, whatever the Router served before."""
    h = hashlib.blake2b(f"{seed}:{req.key}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


def weighted_pick(options, weights, u: float):
    """The option whose cumulative weight first exceeds ``u * sum(weights)`` (``u`` in [0, 1))."""
    total, acc = sum(weights), 0.0
    for opt, w in zip(options, weights):
        acc += w
        if u * total < acc:
            return opt
    return options[-1]


class Policy:
    """Base class of routing policies. Subclass it, in a module or a notebook cell.

    Override:
        route(step) -> str | bool | Resample: after each forward on the owning model; return
            the model that writes next (its own name to stay). With two models a bool works
            too: True hands off to the other model, False stays. `Resample()` discards the
            token and draws the position again on the same model. ``step.set_token(t)``
            changes the token written (e.g. from ``step.peer_logits``).
        route_batch(batch) -> list: vectorised form over a `StepBatch` (shape [B] inputs);
            the default loops over ``route``. Learned routers override this.
        send(req, target) -> Handoff: on a handoff, whether the sampled token is kept and
            how many tokens the target writes. Default: discard, target's route decides.
        receive(handoff, req) -> None: hook on the target before it runs the request (e.g.
            to set per-request state).
        entry(req, models) -> str | None: the model that prefills the request (query-level
            routing); None = the first (smallest) model. ``models`` are all model names,
            smallest first (also ``req.models``); an override written ``entry(self, req)`` is
            called with the request alone.
        may_use(req, models) -> list[str]: the models the request may visit (default: all).
            With ``EngineConfig.prefill_peers`` each of them prefills the prompt at admission.

    Models that do not share a tokenizer: a step's token, logits and hidden states are in the
    owning model's vocabulary, ``step.request.output_ids`` are its own tokens of the committed
    text and ``step.text`` the text itself. Set ``one_vocabulary = True`` on a policy that needs
    one shared vocabulary (a learned head over one vocabulary's tokens): a Router of models with
    different tokenizers refuses it.

    Errors: a hook that raises, or returns a value it may not (a wrong type, an unknown
    model, a `Handoff` with a bad field), fails that request only, with an error naming the
    policy, the hook, the value, what is accepted, the model and the position; other requests
    go on (the accepted values of each hook: `tokenrouter_sdk.engine.core.policy_host`). A
    `route_batch` that raises fails every request of its batch. Each request's decision is
    computed once per step (``route`` is never re-run for a request because a batch-mate
    failed).
    """

    needs: Needs = Needs()  # per-step data this policy reads (see `Needs`)
    one_vocabulary: bool = False  # True: it needs models that share one tokenizer (a Router of others refuses it)

    @property
    def name(self) -> str:
        return type(self).__name__

    def entry(self, req: "RequestView", models: Sequence[str]) -> str | None:
        """The model that prefills request ``req`` and writes its first token (``models``: all
        model names, smallest first); None: the first model. Called once at submission."""
        return None

    def may_use(self, req: "RequestView", models: Sequence[str]) -> Sequence[str]:
        """The models request ``req`` may visit (``req.owner`` is its entry model); called once
        at submission. With ``EngineConfig.prefill_peers`` every one of them other than the
        entry prefills the prompt at admission, so the first handoff to it feeds only the
        tokens written since. Default: every model. A model left out that the policy routes
        to still works (it prefills on its first visit)."""
        return list(models)

    def route(self, step: Step) -> str | bool:
        return step.model

    def route_batch(self, batch: StepBatch) -> list:
        """One decision per request of ``batch`` (a list of ``len(batch)``). The default calls
        `route` once per request; where `route` raises, the exception takes that request's place
        in the list, so that request alone fails and the others' decisions (and the ``state``
        changes their `route` made) stand. An override may do the same: an exception instance
        in the list fails only its request, while a ``route_batch`` that raises fails every
        request of the batch (it is not run again request by request: the state changes it made
        would apply twice)."""
        out: list = []
        for i in range(len(batch)):
            try:
                out.append(self.route(batch[i]))
            except Exception as e:  # noqa: BLE001 - fails this request only (the caller reports it)
                out.append(e)
        return out

    def send(self, req: "RequestView", target: str) -> Handoff:
        return Handoff(keep_sampled=False)

    def receive(self, handoff: Handoff, req: "RequestView") -> None:
        return None

    def __repr__(self) -> str:
        attrs = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{self.name}({attrs})"
