"""The boundary between the engine and a policy's code: what each hook may return, checked before
the engine acts on it.

A policy is user code (a notebook cell, a module). Every value a hook returns passes one of the
checks below; a wrong type or value becomes `PolicyReturnError`, which the caller turns into
that request's failure, with an error naming the policy, the hook, what it returned and what is
accepted. Nothing a policy returns reaches the scheduler unchecked, so no return value can stop a
sub-server (threads or processes) or the engine.

| hook | accepted return values |
|---|---|
| ``entry(req, models)`` (or ``entry(req)``) | a model name, or None (the first model) |
| ``may_use(req, models)`` | a list, tuple or set of model names |
| ``route(step)`` | a model name (its own to stay), a bool with two models (True: hand off), or `Resample()` |
| ``route_batch(batch)`` | a list (or tuple) of ``len(batch)`` route decisions; an exception instance in it fails that request alone |
| ``send(req, target)`` | a `Handoff` (``keep_sampled`` bool, ``span`` None or an int >= 1, ``greedy`` bool), or None (``Handoff()``) |
| ``receive(handoff, req)`` | None |

`check_policy` checks the policy object itself when a call is submitted (an instance, not its
class; ``needs`` a `Needs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence

from ..policy import Handoff, Needs, Policy, Resample

__all__ = ["PolicyReturnError", "describe", "policy_text", "check_policy", "call_entry", "entry_model", "may_use_models",
           "route_decision", "route_batch_decisions", "handoff", "receive_result"]

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
    return text if len(text) <= _REPR_MAX else text[:_REPR_MAX - 3] + "..."


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
            raise TypeError(f"policy={policy.__qualname__} is the class, not an instance: pass "
                            f"{policy.__qualname__}(...) (e.g. policy={policy.__qualname__}())")
        raise TypeError(f"policy must be a tokenrouter_sdk.Policy instance, got the class {policy.__qualname__}")
    if isinstance(policy, str):
        raise TypeError(f"policy must be a Policy instance, got the string {policy!r}: build a built-in one by name "
                        f"with tokenrouter_sdk.policies.registry.build_policy({policy!r}), or import its class "
                        f"from tokenrouter_sdk.policies")
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a tokenrouter_sdk.Policy instance (subclass Policy and override route), "
                        f"got {describe(policy)}")
    needs = getattr(policy, "needs", None)
    if not isinstance(needs, Needs):
        raise TypeError(f"policy {policy_text(policy)}: needs must be a tokenrouter_sdk.Needs, got {describe(needs)}; "
                        f"e.g. needs = Needs(entropy=True) as a class attribute")


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
    raise ValueError(f"policy {policy_text(policy)} needs models that share one tokenizer: {why}; the models "
                     f"{list(models)} have different tokenizers. Route them with a policy that reads each model's "
                     f"own step (RStitch, an entropy or confidence threshold, RandomRouting, TokenEnsemble), or pick "
                     f"models of one family")


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


def call_entry(policy, req, models: Sequence[str]):
    """``policy.entry(req, models)``, or ``policy.entry(req)`` for an override that takes the
    request alone (the models are on ``req.models`` too). Returns what it returned, unchecked
    (see `entry_model`)."""
    fn = policy.entry
    return fn(req, models) if _takes_models(fn) else fn(req)


def entry_model(value, models: Sequence[str]) -> str | None:
    """What ``entry`` returned, checked: a model name, or None.

    Raises:
        PolicyReturnError: anything else.
    """
    if value is None:
        return None
    name = _name(value, models)
    if name is None:
        raise PolicyReturnError(f"returned {describe(value)}; accepted: one of {list(models)} (the model that "
                                f"prefills the request) or None (the first model, {models[0]!r})")
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
        raise PolicyReturnError(f"returned {describe(value)}, where {', '.join(describe(b) for b in bad)} names no "
                                f"model; accepted: {accepted}")
    return out


def _route_accepted(models: Sequence[str]) -> str:
    return (f"one of {list(models)} (the model that writes next; its own name to stay)"
            + (", a bool (True hands off to the other model)" if len(models) == 2 else "") + " or Resample()")


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
        raise PolicyReturnError(f"returned {describe(value)}, but a bool names a model only with two models and "
                                f"there are {len(models)}; accepted: {_route_accepted(models)}")
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
        raise PolicyReturnError(f"returned {describe(value)}{hint}; accepted: a list of {n} decisions, one per "
                                f"request of the batch")
    if len(value) != n:
        raise PolicyReturnError(f"returned {len(value)} decisions for a batch of {n} requests; accepted: a list of "
                                f"{n} decisions, one per request (len(batch))")
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
        raise PolicyReturnError(f"returned {describe(value)}; accepted: a Handoff (e.g. Handoff(keep_sampled=True) "
                                f"or Handoff(keep_sampled=False, span=4)) or None (Handoff())")
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
        raise PolicyReturnError(f"returned {describe(value)}; accepted: None (receive is a hook: set req.state "
                                f"there, route decides where the request goes)")
