"""Built-in policies by name, with typed keyword arguments: ``"rstitch:tau=0.1,signal=entropy"``.

A spec is ``NAME`` or ``NAME:key=value,key=value`` (the form the ``tokenrouter serve --policy``
flag and an HTTP request's ``policy`` field take), or a mapping ``{"name": NAME, key: value}``.
Values are converted to the type each constructor argument is annotated with (int, float,
bool, str, None for optional ones, JSON for lists and dicts), so ``tau=0.1`` reaches `RStitch`
as a float. Arguments that name a file on the machine (a learned router's ``head``, R2R's
``embedding``) can be refused with ``allow_paths=False`` (what a server does for its clients).

`PolicyRegistry` instances are independent: `builtin_registry` returns a fresh one, to which a
server adds its operator's own class (`load_policy_class`) without touching any other.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import NoneType, UnionType
from typing import Any

from ..policy import Policy

PATH_PARAMS = frozenset({"head", "embedding"})


class PolicySpecError(ValueError):
    """A policy spec that names no known policy, or a bad or unknown argument (the message names
    it, lists what is accepted and how to fix it)."""


@dataclass(frozen=True)
class Param:
    """One constructor argument: its name, annotation (None: untyped), default and whether it
    names a file."""

    name: str
    annotation: Any
    default: Any
    path: bool

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty

    def type_name(self) -> str:
        if self.annotation is None or self.path:
            return "path" if self.path else "str"
        names = []
        for opt in _union_args(self.annotation):
            origin = typing.get_origin(opt) or opt
            names.append(
                "None"
                if opt is NoneType
                else "JSON " + origin.__name__
                if origin in (dict, list, tuple, Sequence, Mapping)
                else getattr(opt, "__name__", str(opt))
            )
        return " | ".join(names)


@dataclass(frozen=True)
class Entry:
    """A registered policy: its name, class and typed constructor arguments."""

    name: str
    cls: type
    params: dict[str, Param]

    def signature(self) -> str:
        """``name:arg=default,...`` for help texts (required arguments without a default)."""
        parts = [p.name if p.required else f"{p.name}={p.default!r}" for p in self.params.values()]
        return f"{self.name}:{','.join(parts)}" if parts else self.name


def _params(cls: type) -> dict[str, Param]:
    sig = inspect.signature(cls.__init__)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated: treat as untyped
        hints = {}
    out = {}
    for name, p in sig.parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[name] = Param(name, hints.get(name), p.default, name in PATH_PARAMS)
    return out


def _builtin_classes() -> dict[str, type]:
    from . import (
        CITER,
        R2R,
        CoLLM,
        GlimpRouter,
        LargeOnly,
        QueryRouter,
        R2RAleatoric,
        R2REntropy,
        RandomQueryRouting,
        RandomRouting,
        RandomSpanRouting,
        RStitch,
        SingleModel,
        SmallOnly,
        TokenEnsemble,
    )

    return {
        "rstitch": RStitch,
        "random": RandomRouting,
        "large_only": LargeOnly,
        "small_only": SmallOnly,
        "single": SingleModel,
        "citer": CITER,
        "r2r": R2R,
        "r2r_entropy": R2REntropy,
        "r2r_aleatoric": R2RAleatoric,
        "co_llm": CoLLM,
        "glimprouter": GlimpRouter,
        "ensemble": TokenEnsemble,
        "query_router": QueryRouter,
        "random_query": RandomQueryRouting,
        "random_span": RandomSpanRouting,
    }


class PolicyRegistry:
    """Policies by name. Names are matched case-insensitively, and a class name works too
    (``RStitch`` finds ``rstitch``).

    Args:
        classes: name -> `Policy` subclass (None: empty).
    """

    def __init__(self, classes: Mapping[str, type] | None = None):
        self._entries: dict[str, Entry] = {}
        for name, cls in (classes or {}).items():
            self.add(name, cls)

    def add(self, name: str, cls: type) -> Entry:
        """Register ``cls`` under ``name``.

        Raises:
            TypeError: ``cls`` is not a `Policy` subclass.
        """
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"policy '{name}': {cls!r} is not a subclass of tokenrouter_sdk.Policy")
        entry = Entry(name, cls, _params(cls))
        self._entries[name.lower()] = entry
        return entry

    def names(self) -> list[str]:
        return [e.name for e in self._entries.values()]

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def __contains__(self, name: str) -> bool:
        return self._find(name) is not None

    def _find(self, name: str) -> Entry | None:
        key = name.strip().lower()
        if key in self._entries:
            return self._entries[key]
        return next((e for e in self._entries.values() if e.cls.__name__.lower() == key), None)

    def get(self, name: str) -> Entry:
        """The entry called ``name``.

        Raises:
            PolicySpecError: no such policy (lists the names).
        """
        e = self._find(name)
        if e is None:
            raise PolicySpecError(f"unknown policy {name!r}; known policies: {', '.join(self.names())}")
        return e

    def resolve(self, spec: str | Mapping, *, allow_paths: bool = True) -> tuple[Entry, dict[str, Any]]:
        """The entry and typed keyword arguments of a spec (see the module docstring); nothing is
        built.

        Raises:
            PolicySpecError: unknown name, unknown or badly typed argument, a missing required
                argument, or a file argument when ``allow_paths`` is False.
        """
        name, raw = parse_spec(spec)
        entry = self.get(name)
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            param = entry.params.get(key)
            if param is None:
                accepted = ", ".join(entry.params) or "none"
                raise PolicySpecError(f"policy '{entry.name}' has no argument {key!r}; its arguments: {accepted}")
            if param.path and not allow_paths:
                raise PolicySpecError(
                    f"policy '{entry.name}': argument {key!r} names a file on the server and "
                    f"cannot be set per request; start the server with --policy "
                    f"'{entry.name}:{key}=...' instead"
                )
            kwargs[key] = convert(value, param, entry.name)
        missing = [p.name for p in entry.params.values() if p.required and p.name not in kwargs]
        if missing:
            raise PolicySpecError(
                f"policy '{entry.name}' needs argument(s) {missing}: e.g. '{entry.name}:{missing[0]}=...'"
            )
        return entry, kwargs

    def build(self, spec: str | Mapping, *, allow_paths: bool = True) -> Policy:
        """A new policy from a spec, e.g. ``registry.build("rstitch:tau=0.05")``.

        Raises:
            PolicySpecError: as `resolve`, or the policy's constructor refused the arguments
                (its message is kept).
        """
        entry, kwargs = self.resolve(spec, allow_paths=allow_paths)
        try:
            return entry.cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - the constructor's own check, reported with the spec
            raise PolicySpecError(f"policy '{entry.name}' with {kwargs}: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return f"PolicyRegistry({self.names()})"


def builtin_registry() -> PolicyRegistry:
    """A new registry holding the built-in policies of `tokenrouter_sdk.policies`: rstitch,
    random, large_only, small_only, single, citer, r2r, r2r_entropy, r2r_aleatoric, co_llm,
    glimprouter, ensemble, query_router, random_query, random_span."""
    return PolicyRegistry(_builtin_classes())


def build_policy(spec: str | Mapping, *, allow_paths: bool = True) -> Policy:
    """A built-in policy from a spec: ``build_policy("rstitch:tau=0.1")``.

    Raises:
        PolicySpecError: see `PolicyRegistry.resolve`.
    """
    return builtin_registry().build(spec, allow_paths=allow_paths)


# -- parsing ---------------------------------------------------------------------------------
def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split on ``sep`` outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse_spec(spec: str | Mapping) -> tuple[str, dict[str, Any]]:
    """``"name:k=v,k=v"`` or ``{"name": ..., k: v}`` -> ``(name, {k: v})`` (values as given:
    strings from text, JSON values from a mapping).

    Raises:
        PolicySpecError: an empty name, or an argument without ``=``.
    """
    if isinstance(spec, Mapping):
        raw = dict(spec)
        name = raw.pop("name", None)
        if not isinstance(name, str) or not name.strip():
            raise PolicySpecError(
                f"a policy given as an object needs a 'name', e.g. {{'name': 'rstitch', 'tau': 0.1}}; got {spec!r}"
            )
        return name.strip(), raw
    if not isinstance(spec, str):
        raise PolicySpecError(
            f"a policy spec is a string 'name:key=value,...' or an object with 'name', got {type(spec).__name__}"
        )
    name, _, rest = spec.strip().partition(":")
    if not name.strip():
        raise PolicySpecError(f"empty policy name in {spec!r}; write e.g. 'rstitch:tau=0.1'")
    kwargs: dict[str, Any] = {}
    for item in _split_top(rest, ",") if rest.strip() else []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PolicySpecError(
                f"policy argument {item!r} in {spec!r} is not key=value; write e.g. '{name.strip()}:tau=0.1'"
            )
        kwargs[key.strip()] = value.strip()
    return name.strip(), kwargs


def _union_args(annotation) -> tuple:
    if isinstance(annotation, UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def convert(value: Any, param: Param, policy: str) -> Any:
    """``value`` (a string from a spec, or a JSON value) as ``param``'s annotated type.

    Raises:
        PolicySpecError: the value fits none of the annotated types (names the argument, the
            type and the value).
    """
    ann = param.annotation
    if ann is None:
        return value
    options = _union_args(ann)
    text = value.strip() if isinstance(value, str) else None
    if NoneType in options and (value is None or (text is not None and text.lower() in ("none", "null"))):
        return None
    for opt in options:
        origin = typing.get_origin(opt) or opt
        try:
            if opt is bool:
                if isinstance(value, bool):
                    return value
                if text is not None and text.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                    return text.lower() in ("true", "1", "yes", "on")
            elif opt is int:
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
                if text is not None:
                    return int(text)
            elif opt is float:
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return float(value)
                if text is not None:
                    return float(text)
            elif opt is str or opt is os.PathLike:
                if isinstance(value, str):
                    return value
            elif origin in (dict, Mapping, list, tuple, Sequence) or origin is typing.Any:
                v = json.loads(text) if text is not None else value
                if isinstance(v, (dict, list)):
                    return v
        except (TypeError, ValueError):
            continue
    raise PolicySpecError(f"policy '{policy}': argument {param.name!r} must be {param.type_name()}, got {value!r}")


# -- the operator's own policy ---------------------------------------------------------------
def load_policy_class(target: str) -> type:
    """The `Policy` subclass named by ``"path/to/module.py:ClassName"`` (or
    ``"package.module:ClassName"`` for an importable module).

    A file is imported under a module name of its own, which no other process can import, so
    the module is registered with ``cloudpickle.register_pickle_by_value``: its classes and
    functions travel by value to sub-server processes and Ray actors, as a notebook cell's do.

    Raises:
        PolicySpecError: no ``:``, a missing file, a module that fails to import (its error is
            kept), no such class, or a class that is not a `Policy` subclass.
    """
    where, sep, cls_name = target.rpartition(":")
    if not sep or not where or not cls_name:
        raise PolicySpecError(f"--policy-file takes 'module.py:ClassName', got {target!r}")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise PolicySpecError(f"policy file {str(path)!r} does not exist")
            mod_name = f"tokenrouter_user_policy_{path.stem}_{abs(hash(str(path)))}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
            spec.loader.exec_module(module)
            import cloudpickle

            cloudpickle.register_pickle_by_value(module)  # sub-servers cannot import it by this name
        else:
            module = importlib.import_module(where)
    except PolicySpecError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed: keep its error
        raise PolicySpecError(f"importing {where!r} failed: {type(e).__name__}: {e}") from e
    cls = getattr(module, cls_name, None)
    if cls is None:
        have = sorted(
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Policy) and v is not Policy
        )
        raise PolicySpecError(f"{where!r} has no class {cls_name!r}; its Policy classes: {have or 'none'}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicySpecError(f"{target!r} is not a subclass of tokenrouter_sdk.Policy")
    return cls
