"""`RequestHandle`: one submitted request's growing output, its text and streams, and its end.

Locking: a handle is written only by the engine while it holds its lock (event handling,
admission, abort); its text methods (`RequestHandle.add_text`, ``take_text``, ``finalize_text``)
run there. Readers outside the engine read ``output`` once ``done`` is set, or under
`Engine.consistent`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ...request import RequestConfig, RequestOutput
from .detokenizer import ByteDetokenizer, IncrementalDetokenizer, StopMatcher

if TYPE_CHECKING:
    from .handle_link import CallLink


class RequestHandle:
    """One submitted request: its growing output and text, and its end.

    Attributes:
        output: the `RequestOutput` (grows as tokens are committed; final once ``done``).
        done: set when the request ended (finished, aborted or failed).
        entry: the model it enters on; owner: the model writing it now.
        call: the `Call` it belongs to.
    """

    def __init__(
        self,
        config: RequestConfig,
        prompt,
        entry: str,
        call: "CallLink",
        index: int,
        tokenizer,
        stop_ids: frozenset | dict,
        vocabs: dict | None = None,
    ):
        self.config, self.entry, self.owner, self.call = config, entry, entry, call
        self.output = RequestOutput(rid=config.rid, prompt=prompt, index=index, key=config.key)
        if config.params.logprobs is not None:
            self.output.logprobs = []
            if config.params.logprobs:
                self.output.top_logprobs = []
        self.t_submit = 0.0
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.done = threading.Event()
        self.need: dict[str, int] = {}  # KV blocks reserved per model while admitted (its own)
        self.shared: dict[str, list] = {}  # per model, prefix-cache keys of its prompt blocks others may share
        if vocabs is not None:  # models that do not share a tokenizer: text from each writer's bytes
            self.detok = ByteDetokenizer(vocabs)
        else:
            self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopMatcher(config.params.stop) if config.params.stop else None
        self.stop_ids = stop_ids  # ids that end the request (per writer, a dict): their text is not part of it
        self.released = 0  # characters of text given to streams
        self.final_text: str | None = None
        self.state: dict = {}  # the policy state entry() started
        self.error: str | None = None  # bad input found before admission
        self.peers: tuple[str, ...] = ()  # models that prefill the prompt at admission (prefill_peers)
        self.visited: set[str] = set()  # models that hold (or held) KV of it: its entry, peers, hop targets

    @property
    def rid(self) -> int:
        return self.config.rid

    def reserved_blocks(self, model: str) -> int:
        """KV blocks this request reserves on ``model`` while admitted: its own plus the prompt
        blocks it may share through the prefix cache (0 before `Engine.submit` sized it)."""
        return self.need.get(model, 0) + len(self.shared.get(model, ()))

    def abort(self, reason: str = "aborted by the user") -> None:
        """Abort this request (see `Engine.abort`)."""
        self.call.engine.abort(self.rid, reason)

    # -- text -------------------------------------------------------------------------------
    def add_text(self, tokens: list[int], last: bool, model: str | None = None) -> str:
        """Feed committed tokens (written by ``model``) to the detokenizer; return the text that
        became safe to stream: stable, before any stop string, and not possibly the start of one.
        With ``last`` (the request ends with these tokens) everything up to the final text's end.
        Called by the engine under its lock, once per `Committed` event of this request, in order.

        Args:
            tokens: the committed token ids, in order (ids that end the request are left out of
                the text).
            last: whether the request ends with these tokens.
            model: the model that wrote them (picks its stop ids and, with models that do not
                share a tokenizer, its vocabulary).

        Returns:
            The new text to stream ("" when none, or without a tokenizer).
        """
        if self.detok is None:
            return ""
        stop_ids = self.stop_ids.get(model, ()) if isinstance(self.stop_ids, dict) else self.stop_ids
        ids = [t for t in tokens if t not in stop_ids]
        if self.call.listener is None:  # nobody streams: decode once at the end
            self.detok.extend(ids, model)
            return self.take_text(len(self.finalize_text())) if last else ""
        if ids:
            self.detok.add(ids, model)
        if last:
            return self.take_text(len(self.finalize_text()))
        text = self.detok.text
        limit = len(text)
        if self.stops is not None:
            hit = self.stops.find(text)
            limit = hit[0] if hit else len(text) - self.stops.held(text)
        return self.take_text(limit)

    def take_text(self, limit: int) -> str:
        """The text from the last character given out to character ``limit`` of the final text
        (once known; else of the text decoded so far), marked as given out; "" when ``limit``
        is not past what was given. Called by the engine under its lock."""
        text = self.final_text if self.final_text is not None else self.detok.text
        if limit <= self.released:
            return ""
        piece = text[self.released : limit]
        self.released = limit
        return piece

    def finalize_text(self) -> str:
        """The final text: every token decoded (special tokens skipped), cut before the first
        stop string; computed once (later calls return the same string), "" without a
        tokenizer. Called by the engine under its lock when the request ends."""
        if self.final_text is None:
            if self.detok is None:
                self.final_text = ""
            else:
                self.detok.flush()
                text = self.detok.text
                hit = self.stops.find(text) if self.stops is not None else None
                self.final_text = text[: hit[0]] if hit else text
        return self.final_text
