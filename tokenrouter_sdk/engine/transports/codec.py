"""The typed wire between the engine and sub-server processes: every message and event with an
explicit schema.

Each message class of `tokenrouter_sdk.engine.messages` (plus `PolicyBlob`, a policy on the
wire) has a one-byte tag in `MESSAGES`. `encode` writes the tag, then the message's fields in
declaration order as one msgpack array (msgspec); `decode` reads the tag and checks the array
against the class's field annotations (`msgspec.ValidationError` names a field of the wrong
type), so both ends agree on one schema, written once: the dataclass. Fields that hold user
data of any type (`OPAQUE`: the policy's per-request state, a tensor of logits) travel as
pickle bytes inside the array (cloudpickle when plain pickle refuses, e.g. a state value of a
class defined in a notebook); a policy itself travels cloudpickled in a `PolicyBlob`. An
unknown tag or message type raises `UnknownMessage`.

Frames (`Frame`): the first frame of every multipart message a sub-server process sends the
hub says what the rest is.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import typing
from typing import Any

import msgspec

from .. import messages
from ..step_result import UnknownMessage

_PROTO = pickle.HIGHEST_PROTOCOL


class Frame(enum.Enum):
    """The first frame of every multipart message a sub-server process sends the hub.

    Members:
        HELLO: ``[HELLO, boot JSON]``, once, when the process has built its sub-server.
        RESULT: ``[RESULT, n events, event..., (peer model, message)...]``: one `StepResult`
            (`encode_result`); the hub forwards the messages as bytes, then hands the events on.
        ERROR: ``[ERROR, text]``: why the process is about to end.
    """

    HELLO = b"hi"
    RESULT = b"rs"
    ERROR = b"er"


FRAMES = {f.value: f for f in Frame}


@dataclasses.dataclass
class PolicyBlob:
    """`RegisterPolicy` on the wire: the policy cloudpickled (``data``), its repr (``text``) and
    where its code lives (``sources``, see `wire.policy_sources`). The receiving process loads
    it with `wire.load_policy`, so a policy it cannot load fails only the requests that use it."""

    key: int
    data: bytes
    text: str
    sources: dict[str, tuple[str, Any]] | None = None  # qualname -> (file, linecache entry or None)


MESSAGES: tuple[type, ...] = (
    messages.Admit,
    messages.Prefill,
    messages.HandoffMsg,
    messages.Release,
    messages.Abort,
    messages.RegisterPolicy,
    messages.UnregisterPolicy,
    messages.Shutdown,
    messages.Go,
    messages.SetThresholds,
    messages.SetInflight,
    messages.StatsQuery,
    messages.Admitted,
    messages.Committed,
    messages.Hopped,
    messages.Resampled,
    messages.Finished,
    messages.StepDone,
    messages.Idle,
    messages.ModelDied,
    messages.Stats,
    PolicyBlob,
    messages.ClearPrefixCache,
    messages.Retokenized,
)
"""Every type that travels, in tag order (append new ones at the end)."""

OPAQUE: dict[type, frozenset[str]] = {
    messages.Admit: frozenset({"state"}),
    messages.RequestState: frozenset({"state", "peer_logits"}),
    messages.RegisterPolicy: frozenset({"policy"}),
}
"""Per type, the fields of user data that travel pickled (any Python value)."""


def _opaque_dump(value) -> bytes:
    if value is None:
        return b""
    if type(value) is dict and not value:  # the common policy state: none
        return b"{}"
    try:
        return pickle.dumps(value, _PROTO)
    except Exception:  # noqa: BLE001 - a value of a class defined in __main__ or a notebook cell
        import cloudpickle

        return cloudpickle.dumps(value, _PROTO)


def _opaque_load(data: bytes):
    if data == b"":
        return None
    if data == b"{}":
        return {}
    return pickle.loads(data)


NESTED: tuple[type, ...] = (messages.RequestState,)
"""Dataclasses inside messages that travel field by field (with their own opaque fields)."""

_PLAIN, _OPAQUE, _NESTED = 0, 1, 2


class _Schema:
    """How one dataclass travels: its field names, how each travels (plain, opaque, nested)
    and the msgspec type of its field array."""

    def __init__(self, cls: type):
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.fields = [f.name for f in dataclasses.fields(cls)]
        self.kinds, self.nested, types = [], [], []
        for name in self.fields:
            t = hints[name]
            nested = _nested_type(t)
            self.nested.append(nested)
            if name in OPAQUE.get(cls, ()):
                self.kinds.append(_OPAQUE)
                types.append(bytes)
            elif nested is not None:
                self.kinds.append(_NESTED)
                wire = _SCHEMA_OF[nested].wire_type
                types.append(wire if t is nested else typing.Optional[wire])
            else:
                self.kinds.append(_PLAIN)
                types.append(t)
        self.wire_type = tuple[tuple(types)] if types else tuple[()]

    def to_wire(self, msg) -> list:
        values = [getattr(msg, name) for name in self.fields]
        for i, kind in enumerate(self.kinds):
            if kind == _OPAQUE:
                values[i] = _opaque_dump(values[i])
            elif kind == _NESTED and values[i] is not None:
                values[i] = _SCHEMA_OF[type(values[i])].to_wire(values[i])
        return values

    def from_wire(self, values):
        values = list(values)
        for i, kind in enumerate(self.kinds):
            if kind == _OPAQUE:
                values[i] = _opaque_load(values[i])
            elif kind == _NESTED and values[i] is not None:
                values[i] = _SCHEMA_OF[self.nested[i]].from_wire(values[i])
        return self.cls(*values)


def _nested_type(t) -> type | None:
    """The `NESTED` type ``t`` is (or is optional of), else None."""
    if t in NESTED:
        return t
    args = typing.get_args(t)
    hit = [a for a in args if a in NESTED]
    return hit[0] if hit and set(args) <= {hit[0], type(None)} else None


_SCHEMA_OF: dict[type, _Schema] = {}
for _cls in NESTED:
    _SCHEMA_OF[_cls] = _Schema(_cls)
for _cls in MESSAGES:
    _SCHEMA_OF[_cls] = _Schema(_cls)
_TAG = {cls: bytes([i]) for i, cls in enumerate(MESSAGES)}
_DECODERS = [msgspec.msgpack.Decoder(_SCHEMA_OF[cls].wire_type) for cls in MESSAGES]
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    """The bytes of one message: its tag, then its fields as a msgpack array.

    Raises:
        UnknownMessage: ``msg``'s type is not in `MESSAGES`.
        TypeError: a field holds a value its schema cannot carry (names the message and field).
    """
    tag = _TAG.get(type(msg))
    if tag is None:
        raise UnknownMessage(
            f"cannot send a message of unknown type {type(msg).__module__}."
            f"{type(msg).__qualname__}; known: {', '.join(c.__name__ for c in MESSAGES)}"
        )
    schema = _SCHEMA_OF[type(msg)]
    values = schema.to_wire(msg)
    try:
        return tag + _ENCODER.encode(values)
    except (TypeError, OverflowError) as e:
        bad = next((n for n, v in zip(schema.fields, values) if not _encodable(v)), "?")
        raise TypeError(f"{type(msg).__name__}.{bad} cannot be sent to a sub-server process: {e}") from e


def _encodable(v) -> bool:
    try:
        _ENCODER.encode(v)
        return True
    except (TypeError, OverflowError):
        return False


def decode(data: bytes):
    """The message `encode` made of ``data``.

    Raises:
        UnknownMessage: the tag names no type of `MESSAGES` (a peer of another version).
        msgspec.ValidationError: a field does not match its type (names the field's position).
    """
    if not data or data[0] >= len(MESSAGES):
        raise UnknownMessage(
            f"message with unknown tag {data[:1]!r} ({len(data)} bytes); "
            f"sender and receiver must run the same tokenrouter_sdk"
        )
    cls = MESSAGES[data[0]]
    return _SCHEMA_OF[cls].from_wire(_DECODERS[data[0]].decode(memoryview(data)[1:]))


def encode_result(res) -> list[bytes]:
    """The frames of a `StepResult` (see `Frame.RESULT`)."""
    frames = [Frame.RESULT.value, str(len(res.events)).encode()]
    frames.extend(encode(ev) for ev in res.events)
    for model, msg in res.messages:
        frames.append(model.encode())
        frames.append(encode(msg))
    return frames


def split_result(frames: list[bytes]) -> tuple[list[bytes], list[tuple[str, bytes]]]:
    """The encoded events and ``(peer model, encoded message)`` pairs of `encode_result`'s
    frames (less the kind frame)."""
    n = int(frames[0])
    events = frames[1 : 1 + n]
    rest = frames[1 + n :]
    return events, [(rest[i].decode(), rest[i + 1]) for i in range(0, len(rest), 2)]
