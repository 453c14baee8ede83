"""The policy host: the one place that runs a policy's code. It owns the registered policies of
a sub-server, calls every hook (``entry`` and ``may_use`` for the engine's submission; ``route``
/ ``route_batch``, ``send`` and ``receive`` for a sub-server's step), checks what each returns
before the engine acts on it, and turns whatever goes wrong into that request's failure with an
error naming the policy, the hook, the value or exception, the model and the request.

A policy is user code (a notebook cell, a module). Every value a hook returns passes one of the
checks below; a wrong type or value becomes `PolicyReturnError`, which the host turns into that
request's failure (`RequestFailed` on a sub-server, an error string at submission), with an error
naming the policy, the hook, what it returned and what is accepted. Nothing a policy returns
reaches the scheduler unchecked, so no return value can stop a sub-server (threads or processes)
or the engine.

| hook | accepted return values |
|---|---|
| ``entry(req, models)`` (or ``entry(req)``) | a model name, or None (the first model) |
| ``may_use(req, models)`` | a list, tuple or set of model names |
| ``route(step)`` | a model name (its own to stay), a bool with two models (True: hand off), or `Resample()` |
| ``route_batch(batch)`` | a list or tuple of ``len(batch)`` decisions (an exception in it fails its request) |
| ``send(req, target)`` | a `Handoff` (``keep_sampled``, ``span`` None or >= 1, ``greedy``), or None (``Handoff()``) |
| ``receive(handoff, req)`` | None |

`check_policy` checks the policy object itself when a call is submitted (an instance, not its
class; ``needs`` a `Needs`). The ``call_*`` functions run one hook and check its return (the
naive reference uses them as they are); `PolicyHost` adds the registry and the error wording.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ...policy import Handoff, Needs, Policy, Resample, StepBatch
from ...request import RequestView
from .commit_rules import given_tokens

if TYPE_CHECKING:
    from .scheduler import Seq

__all__ = [
    "PolicyHost",
    "RequestFailed",
    "PolicyReturnError",
    "describe",
    "policy_text",
    "check_policy",
    "check_vocabulary",
    "call_entry",
    "call_may_use",
    "call_route_batch",
    "call_send",
    "call_receive",
    "entry_model",
    "may_use_models",
    "route_decision",
    "route_batch_decisions",
    "handoff",
    "receive_result",
]

_REPR_MAX = 120


class PolicyReturnError(TypeError):
    """A policy hook returned a value of a type or range it may not return. The message says what
    it returned and what is accepted; the caller adds the policy, the hook and the request."""


def _safe_repr(obj) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a user __repr__ that raises must not hide the real error
        text = f"<{type(obj).__name__} object>"
    if not isinstance(text, str):
        text = f"<{type(obj).__name__} object>"
    return text if len(text) <= _REPR_MAX else text[: _REPR_MAX - 3] + "..."


def describe(value) -> str:
    """``value`` as an error message shows it: its repr (cut at 120 characters) and its type,
    e.g. ``True (bool)``, ``'2' (str)``, ``tensor(True) (torch.Tensor)``."""
    t = type(value)
    kind = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__qualname__}"
    return f"{_safe_repr(value)} ({kind})"


def policy_text(policy) -> str:
    """How errors name a policy: its repr, or ``<ClassName>`` when its ``__repr__`` raises."""
    return _safe_repr(policy)


def check_policy(policy) -> None:
    """Raise a clear error unless ``policy`` is a `Policy` instance whose ``needs`` is a `Needs`.

    Raises:
        TypeError: a class where an instance is expected (``policy=MyPolicy``: pass
            ``MyPolicy()``), a policy name (a str: build it with
            `tokenrouter_sdk.policies.registry.build_policy`), any other object, or ``needs`` that
            is not a `Needs`.
    """
    if isinstance(policy, type):
        if issubclass(policy, Policy):
            raise TypeError(
                f"policy={policy.__qualname__} is the class, not an instance: pass "
                f"{policy.__qualname__}(...) (e.g. policy={policy.__qualname__}())"
            )
        raise TypeError(f"policy must be a tokenrouter_sdk.Policy instance, got the class {policy.__qualname__}")
    if isinstance(policy, str):
        raise TypeError(
            f"policy must be a Policy instance, got the string {policy!r}: build a built-in one by name "
            f"with tokenrouter_sdk.policies.registry.build_policy({policy!r}), or import its class "
            f"from tokenrouter_sdk.policies"
        )
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a tokenrouter_sdk.Policy instance (subclass Policy and override route), "
            f"got {describe(policy)}"
        )
    needs = getattr(policy, "needs", None)
    if not isinstance(needs, Needs):
        raise TypeError(
            f"policy {policy_text(policy)}: needs must be a tokenrouter_sdk.Needs, got {describe(needs)}; "
            f"e.g. needs = Needs(entropy=True) as a class attribute"
        )


def check_vocabulary(policy, models: Sequence[str], mixed: bool) -> None:
    """Refuse a policy that needs one shared vocabulary (``Policy.one_vocabulary``: a learned
    head over one vocabulary's tokens; ``Needs(handoff_logits=True)``: a peer's logits) for
    models that do not share a tokenizer (``mixed``).

    Raises:
        ValueError: naming the policy, why, and the policies that work across vocabularies.
    """
    if not mixed:
        return
    if getattr(policy, "one_vocabulary", False):
        why = "its learned head was trained on the tokens of one vocabulary"
    elif getattr(getattr(policy, "needs", None), "handoff_logits", False):
        why = "it reads the handing-off model's logits (Needs(handoff_logits=True)), which are over another vocabulary"
    else:
        return
    raise ValueError(
        f"policy {policy_text(policy)} needs models that share one tokenizer: {why}; the models "
        f"{list(models)} have different tokenizers. Route them with a policy that reads each model's "
        f"own step (RStitch, an entropy or confidence threshold, RandomRouting, TokenEnsemble), or pick "
        f"models of one family"
    )


def _name(value, models: Sequence[str]) -> str | None:
    """``value`` as one of ``models`` (a str equal to one of them), else None."""
    if isinstance(value, str):
        name = str.__str__(value)
        if name in models:
            return name
    return None


def _takes_models(fn) -> bool:
    """Whether a bound ``entry`` takes the models as well as the request (``entry(req, models)``,
    or ``*args``); an override written as ``entry(self, req)`` takes the request alone."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2


def entry_model(value, models: Sequence[str]) -> str | None:
    """What ``entry`` returned, checked: a model name, or None.

    Raises:
        PolicyReturnError: anything else.
    """
    if value is None:
        return None
    name = _name(value, models)
    if name is None:
        raise PolicyReturnError(
            f"returned {describe(value)}; accepted: one of {list(models)} (the model that "
            f"prefills the request) or None (the first model, {models[0]!r})"
        )
    return name


def may_use_models(value, models: Sequence[str]) -> list[str]:
    """What ``may_use`` returned, checked: the model names, in the order given.

    Raises:
        PolicyReturnError: not a list, tuple or set (a single name included: ``"large"`` must
            be ``["large"]``), or a name that is not a model.
    """
    accepted = f"a list of model names from {list(models)} (e.g. {[models[-1]]!r})"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise PolicyReturnError(f"returned {describe(value)}; accepted: {accepted}")
    out, bad = [], []
    for m in value:
        name = _name(m, models)
        (out if name is not None else bad).append(name if name is not None else m)
    if bad:
        raise PolicyReturnError(
            f"returned {describe(value)}, where {', '.join(describe(b) for b in bad)} names no "
            f"model; accepted: {accepted}"
        )
    return out


def _route_accepted(models: Sequence[str]) -> str:
    return (
        f"one of {list(models)} (the model that writes next; its own name to stay)"
        + (", a bool (True hands off to the other model)" if len(models) == 2 else "")
        + " or Resample()"
    )


def route_decision(value, models: Sequence[str], own: str) -> str | Resample:
    """One ``route`` decision on model ``own``, checked: the target model's name or `Resample`
    (a bool with two models becomes the other model or ``own``).

    Raises:
        PolicyReturnError: anything else (an unknown name, an int, a bool with three or more
            models, a tensor, ...).
    """
    if isinstance(value, Resample):
        return value
    if isinstance(value, bool):
        if len(models) == 2:
            return models[1 - list(models).index(own)] if value else own
        raise PolicyReturnError(
            f"returned {describe(value)}, but a bool names a model only with two models and "
            f"there are {len(models)}; accepted: {_route_accepted(models)}"
        )
    name = _name(value, models)
    if name is not None:
        return name
    hint = ""
    if type(value).__module__.split(".")[0] in ("torch", "numpy"):
        hint = " (a tensor or array element: convert it, e.g. bool(x) or x.tolist())"
    raise PolicyReturnError(f"returned {describe(value)}{hint}; accepted: {_route_accepted(models)}")


def route_batch_decisions(value, n: int) -> list:
    """What ``route_batch`` returned for a batch of ``n`` requests, checked as a container: a list
    or tuple of ``n`` items (each then checked by `route_decision`, or an exception instance
    that fails its request).

    Raises:
        PolicyReturnError: not a list or tuple, or not ``n`` items.
    """
    if not isinstance(value, (list, tuple)):
        hint = " (a tensor: return .tolist())" if type(value).__module__.split(".")[0] in ("torch", "numpy") else ""
        raise PolicyReturnError(
            f"returned {describe(value)}{hint}; accepted: a list of {n} decisions, one per request of the batch"
        )
    if len(value) != n:
        raise PolicyReturnError(
            f"returned {len(value)} decisions for a batch of {n} requests; accepted: a list of "
            f"{n} decisions, one per request (len(batch))"
        )
    return list(value)


def handoff(value) -> Handoff:
    """What ``send`` returned, checked: a fresh `Handoff` with valid fields (None: ``Handoff()``).

    Raises:
        PolicyReturnError: not a Handoff or None, or a field of the wrong type or range
            (`Handoff.check`; fields may have been changed after it was built).
    """
    if value is None:
        return Handoff()
    if not isinstance(value, Handoff):
        raise PolicyReturnError(
            f"returned {describe(value)}; accepted: a Handoff (e.g. Handoff(keep_sampled=True) "
            f"or Handoff(keep_sampled=False, span=4)) or None (Handoff())"
        )
    try:
        value.check()
    except (TypeError, ValueError) as e:
        raise PolicyReturnError(f"returned {describe(value)}: {e}") from None
    return Handoff(keep_sampled=value.keep_sampled, span=value.span, greedy=value.greedy)


def receive_result(value) -> None:
    """What ``receive`` returned, checked: None.

    Raises:
        PolicyReturnError: anything else (``receive`` cannot refuse a handoff: set
            ``req.state`` there, and route from it).
    """
    if value is not None:
        raise PolicyReturnError(
            f"returned {describe(value)}; accepted: None (receive is a hook: set req.state "
            f"there, route decides where the request goes)"
        )


# -- the hooks, called and checked: the only calls of a policy's hooks in the package -----------
def call_entry(policy, req: RequestView, models: Sequence[str]) -> str | None:
    """``policy.entry(req, models)`` (or ``policy.entry(req)`` for an override that takes the
    request alone; the models are on ``req.models`` too), checked (`entry_model`): a model name,
    or None for the first model.

    Raises:
        PolicyReturnError: it returned anything else; whatever the hook raises, unchanged.
    """
    fn = policy.entry
    return entry_model(fn(req, models) if _takes_models(fn) else fn(req), models)


def call_may_use(policy, req: RequestView, models: Sequence[str]) -> list[str]:
    """``policy.may_use(req, models)``, checked (`may_use_models`): the model names, in order.

    Raises:
        PolicyReturnError: it returned anything else; whatever the hook raises, unchanged.
    """
    return may_use_models(policy.may_use(req, models), models)


def call_route_batch(policy, batch: StepBatch, n: int) -> list:
    """``policy.route_batch(batch)`` for a batch of ``n`` requests, checked as a container
    (`route_batch_decisions`): ``n`` items, each still to be checked by `route_decision` (or an
    exception instance that fails its request).

    Raises:
        PolicyReturnError: not a list or tuple of ``n`` items; whatever the hook raises, unchanged.
    """
    return route_batch_decisions(policy.route_batch(batch), n)


def call_send(policy, req: RequestView, target: str) -> Handoff:
    """``policy.send(req, target)``, checked (`handoff`): a fresh, valid `Handoff`.

    Raises:
        PolicyReturnError: it returned anything else; whatever the hook raises, unchanged.
    """
    return handoff(policy.send(req, target))


def call_receive(policy, h: Handoff, req: RequestView) -> None:
    """``policy.receive(h, req)``, checked (`receive_result`): None.

    Raises:
        PolicyReturnError: it returned anything else; whatever the hook raises, unchanged.
    """
    receive_result(policy.receive(h, req))


class RequestFailed(Exception):
    """A request-level error: fails that request only. ``args``: ``(message,)`` or ``(message,
    formatted traceback)``, as `SubServer` passes them to the request's ``Finished``."""


def _policy_frame(filename: str) -> bool:
    """Whether a traceback frame is the policy's own code (not the SDK around it; the built-in
    policies count as the policy's). The generated ``__init__`` of a dataclass (file
    ``<string>``, e.g. `Handoff` checking its fields) is left out by the caller."""
    f = filename.replace("\\", "/")
    return "tokenrouter_sdk/" not in f or "tokenrouter_sdk/policies/" in f


class PolicyHost:
    """Runs the policies' hooks for one model's sub-server (``model``) or for the engine's
    submission (``model=""``): owns the registered policies (key -> `Policy`), calls the hooks,
    checks their returns and words every error, and hands back plain decisions.

    Args:
        model: the model whose sub-server runs the hooks ("" for the engine).
        models: all model names, smallest first.
        tokenizer: the model's tokenizer (``step.tokenizer``, ``req.text``); None for none.

    Hooks that raise or return what they may not never propagate: the sub-server hooks give a
    `RequestFailed` (returned in the decisions, raised by `send`, returned by `receive`), the
    submission hooks an error string, each naming the policy, the hook, the value or exception,
    the model and the request.
    """

    def __init__(self, model: str, models: Sequence[str], tokenizer=None):
        self.model, self.models, self.tokenizer = model, list(models), tokenizer
        self.policies: dict[int, Policy] = {}

    def add(self, key: int, policy: Policy) -> None:
        """Register ``policy`` under ``key`` (the requests' ``RequestConfig.policy_key``)."""
        self.policies[key] = policy

    def remove(self, key: int) -> None:
        """Forget the policy of ``key`` (no error when none is registered)."""
        self.policies.pop(key, None)

    def needs(self, key: int, flag: str) -> bool:
        """Whether the policy registered under ``key`` declares ``Needs(flag=True)`` (False
        when none is registered)."""
        pol = self.policies.get(key)
        return pol is not None and bool(getattr(pol.needs, flag, False))

    # -- submission: entry and may_use ---------------------------------------------------------
    def entry(self, policy: Policy, req: RequestView) -> tuple[str, str | None]:
        """``(entry model, error)`` of a request about to be submitted: the model ``entry``
        names (the first model for None), or the first model and the error that fails it."""
        try:
            e = call_entry(policy, req, self.models)
            return (e if e is not None else self.models[0]), None
        except PolicyReturnError as ex:
            return self.models[0], f"policy {policy_text(policy)}.entry {ex} (request {req.rid})"
        except Exception as ex:  # noqa: BLE001 - a policy error fails this request only
            return self.models[0], (
                f"policy {policy_text(policy)}.entry raised {type(ex).__name__}: {ex} (request {req.rid})"
            )

    def may_use(self, policy: Policy, req: RequestView) -> tuple[tuple[str, ...], str | None]:
        """``(peers, error)`` of a request entering on ``req.owner``: the models ``may_use``
        allows other than the entry (in model order, to prefill at admission), or ``()`` and the
        error that fails it."""
        try:
            use = call_may_use(policy, req, self.models)
            return tuple(m for m in self.models if m in use and m != req.owner), None
        except PolicyReturnError as ex:
            return (), f"policy {policy_text(policy)}.may_use {ex} (request {req.rid})"
        except Exception as ex:  # noqa: BLE001 - a policy error fails this request only
            return (), (f"policy {policy_text(policy)}.may_use raised {type(ex).__name__}: {ex} (request {req.rid})")

    # -- the error wording of a sub-server's hooks -------------------------------------------
    def name(self, s: Seq) -> str:
        """How errors name the policy of ``s`` (its repr; never raises)."""
        return policy_text(self.policies.get(s.config.policy_key))

    def raised(self, s: Seq, fn: str, e: BaseException) -> tuple[str, str]:
        """(message, formatted traceback) of policy method ``fn`` raising ``e`` for ``s``: the
        message names the policy, its source file and line, the model and the position."""
        frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
        own = [
            f for f in frames if _policy_frame(f.filename) and not (f.filename == "<string>" and f.name == "__init__")
        ]
        where = (own or frames or [None])[-1]
        loc = f" at {where.filename}:{where.lineno}" if where else ""
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            text = str(e)
        except Exception:  # noqa: BLE001 - an exception whose __str__ raises
            text = "<unprintable>"
        return (
            f"policy {self.name(s)}.{fn} raised {type(e).__name__}: {text}{loc} on model '{self.model}' "
            f"at output position {s.request_state.n_committed} of request {s.rid}",
            tb,
        )

    def returned(self, s: Seq, fn: str, e: Exception) -> str:
        """The message of policy method ``fn`` returning a value it may not (`PolicyReturnError`)."""
        return (
            f"policy {self.name(s)}.{fn} {e} (on model '{self.model}' at output position {s.request_state.n_committed} "
            f"of request {s.rid})"
        )

    def view(self, s: Seq) -> RequestView:
        """What a policy sees of ``s`` on this model (`RequestView`; its text decoded when read)."""
        if s.text is not None:
            text = s.text.text
        else:
            tok = self.tokenizer
            text = (lambda: tok.decode(s.output_ids, skip_special_tokens=True)) if tok is not None else ""
        return RequestView(
            rid=s.rid,
            prompt_ids=s.config.prompt_of(self.model),
            output_ids=s.output_ids,
            owner=self.model,
            state=s.request_state.state,
            hops=s.request_state.hops,
            models=tuple(self.models),
            key=s.config.key,
            text_of=text,
        )

    # -- a sub-server's hooks: route, send, receive ------------------------------------------
    def decide(
        self,
        batch: list[Seq],
        tokens: list[int],
        logits: torch.Tensor,
        hidden: torch.Tensor,
        prompt_hidden: list,
        draw: Callable[[list[int]], list[int]],
        resampled: Callable[[Seq, int], None],
        limit: int,
    ) -> list:
        """The final decision per request of ``batch`` (`route`), with every `Resample` carried
        out: the token is discarded (``resampled(seq, token)`` reports it), the position drawn
        again from the same logits (``draw(rows) -> tokens``, written into ``tokens``) and routed
        again, until the policy lets a draw stand. A request inside its forced output stays;
        one resampled more than ``limit`` times in a row fails. Returns per request a model
        name or a `RequestFailed`."""
        decisions = self.route(batch, tokens, logits, hidden, prompt_hidden, range(len(batch)))
        while True:
            redo = []
            for i, d in enumerate(decisions):
                if not isinstance(d, Resample):
                    continue
                s = batch[i]
                if s.request_state.n_committed < len(s.config.forced):  # a given token: nothing to draw again
                    decisions[i] = self.model
                    continue
                s.resamples += 1
                if s.resamples > limit:
                    decisions[i] = RequestFailed(
                        f"policy {self.name(s)} resampled output position {s.request_state.n_committed} "
                        f"of request {s.rid} {s.resamples} times in a row on model '{self.model}'; let a draw "
                        f"stand (return the model) after at most {limit}"
                    )
                    continue
                s.request_state.discarded += 1
                resampled(s, tokens[i])
                redo.append(i)
            if not redo:
                return decisions
            for i, t in zip(redo, draw(redo)):
                tokens[i] = t
            for i, d in zip(redo, self.route(batch, tokens, logits, hidden, prompt_hidden, redo)):
                decisions[i] = d

    def route(
        self, batch: list[Seq], tokens: list[int], logits: torch.Tensor, hidden: torch.Tensor, prompt_hidden: list, idx
    ) -> list:
        """Decisions for the requests of ``batch`` at rows ``idx``: per row a model name, a
        `Resample`, or a `RequestFailed` that fails it. A request inside a forced span goes on
        (its owner until the span's last token, then back) without asking the policy; the others
        are routed once per policy, one `StepBatch` each. A token a policy set (`Step.set_token`)
        replaces the sampled one in ``tokens`` (but for a given token of teacher forcing,
        `given_tokens`).

        Args:
            batch: the step's requests; ``tokens``: the sampled token per request of ``batch``;
                ``logits`` [B, V], ``hidden`` [B, H]: the step's rows for ``batch``;
                ``prompt_hidden``: per request its prompt's hidden states [P, H] or None.
        """
        idx = list(idx)
        out: list = [None] * len(idx)
        groups: dict[int, list[int]] = {}
        for j, i in enumerate(idx):
            s = batch[i]
            if s.request_state.span is not None:
                out[j] = s.request_state.return_to if s.request_state.span <= 1 else self.model
            else:
                groups.setdefault(s.config.policy_key, []).append(j)
        for key, js in groups.items():
            rows_i = [idx[j] for j in js]
            pol = self.policies.get(key)
            if pol is None:
                for j in js:
                    out[j] = RequestFailed(f"request {batch[idx[j]].rid}: its policy is no longer registered")
                continue
            res, fn = self._route_group(pol, batch, tokens, logits, hidden, prompt_hidden, rows_i)
            for k, j in enumerate(js):
                s, d = batch[idx[j]], res[k]
                if isinstance(d, RequestFailed):
                    out[j] = d
                elif isinstance(d, BaseException):
                    out[j] = RequestFailed(*self.raised(s, fn, d))
                else:
                    try:
                        out[j] = route_decision(d, self.models, self.model)
                    except PolicyReturnError as e:
                        out[j] = RequestFailed(self.returned(s, fn, e))
        return out

    def _route_group(
        self, pol: Policy, batch: list[Seq], tokens: list[int], logits, hidden, prompt_hidden: list, rows_i: list[int]
    ) -> tuple[list, str]:
        """One ``route_batch`` call for the rows ``rows_i`` of one policy: (per row its raw
        decision or a `RequestFailed`, the hook name errors use)."""
        n = len(rows_i)
        rows = None if rows_i == list(range(len(batch))) else torch.tensor(rows_i, dtype=torch.long)
        step_batch = StepBatch(
            self.model,
            self.models,
            torch.tensor([tokens[i] for i in rows_i]),
            logits,
            hidden,
            [self.view(batch[i]) for i in rows_i],
            self.tokenizer,
            needs=pol.needs,
            rows=rows,
            policy=policy_text(pol),
            peer_logits=[batch[i].request_state.peer_logits for i in rows_i],
            prompt_hidden=[prompt_hidden[i] for i in rows_i],
        )
        fn = "route" if type(pol).route_batch is Policy.route_batch else "route_batch"  # the default calls route
        try:  # once: never re-run for a request because another one failed (state changes apply once)
            res = call_route_batch(pol, step_batch, n)
        except PolicyReturnError as e:
            res = [
                RequestFailed(
                    self.returned(batch[i], "route_batch", e) + f"; the {n} requests of this batch fail with it"
                )
                for i in rows_i
            ]
        except Exception as e:  # noqa: BLE001 - one vectorised decision: every request of it fails
            res = []
            for i in rows_i:
                msg, tb = self.raised(batch[i], "route_batch", e)
                res.append(
                    RequestFailed(
                        msg + f"; the {n} requests of this batch fail with it (route_batch "
                        f"is not run again request by request; to fail one request alone, put "
                        f"the exception in its place in the returned list, or raise in route "
                        f"with the default route_batch)",
                        tb,
                    )
                )
        if step_batch.tokens_changed:
            for k, i in enumerate(rows_i):
                tokens[i] = int(step_batch.tokens[k])
            forced = given_tokens(batch, [tokens[i] for i in rows_i], rows_i)
            for k, i in enumerate(rows_i):
                tokens[i] = forced[k]
        return res, fn

    def check_hops(self, s: Seq, limit: int) -> None:
        """Fail ``s`` when its policy handed it off more than ``limit`` times in a row without
        a commit (``s.request_state.hops_since_commit``, counted by the caller).

        Raises:
            RequestFailed: naming the policy, the request, the count and the fix.
        """
        if s.request_state.hops_since_commit > limit:
            raise RequestFailed(
                f"policy {self.name(s)} handed request {s.rid} off "
                f"{s.request_state.hops_since_commit} times in a row without committing a token (ping-pong between "
                f"models); let the receiving model keep its token (Handoff(keep_sampled=True)) or stay"
            )

    def send(self, s: Seq, target: str) -> Handoff:
        """The `Handoff` the policy of ``s`` gives for handing it to ``target``.

        Raises:
            RequestFailed: ``send`` raised or returned what it may not (the message names both).
            KeyError: no policy is registered for ``s`` (an internal error of the caller).
        """
        pol = self.policies[s.config.policy_key]
        try:
            return call_send(pol, self.view(s), target)
        except PolicyReturnError as e:
            raise RequestFailed(self.returned(s, "send", e)) from e
        except Exception as e:  # noqa: BLE001
            raise RequestFailed(*self.raised(s, "send", e)) from e

    def receive(self, s: Seq, keep_sampled: bool) -> tuple | None:
        """Run the ``receive`` hook of ``s`` arriving here (``Handoff(keep_sampled, s.request_state.span,
        s.request_state.greedy)``); None when it went well, else the ``Finished`` error arguments
        (message, and the traceback when it raised) that fail the request."""
        pol = self.policies.get(s.config.policy_key)
        try:
            if pol is None:
                raise RuntimeError("the request's policy is no longer registered")
            call_receive(pol, Handoff(keep_sampled, s.request_state.span, s.request_state.greedy), self.view(s))
        except PolicyReturnError as e:
            return (self.returned(s, "receive", e),)
        except Exception as e:  # noqa: BLE001 - a policy error fails this request only
            return self.raised(s, "receive", e)
        return None
