"""`RequestHandle`: one submitted request's growing output, its text and streams, and its end.

A handle owns the rule that stop strings end a request: it makes the request's text, so it
finds them there (`RequestHandle.commit`) and the engine ends the request; the sub-servers decide
every other end (stop token ids, EOS, length) where the tokens are committed.

Locking: a handle is written only by the engine while it holds its lock (event handling,
admission, abort); its output methods (`RequestHandle.commit`, ``take_text``, ``finalize_text``)
run there. Readers outside the engine read ``output`` once ``done`` is set, or under
`Engine.consistent`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

from ...request import RequestConfig, RequestOutput
from ..messages import Committed
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
        self.stop_hit: str | None = None  # the stop string that ended the request
        self._searched = 0  # characters of text (with pending bytes) searched for stop strings
        self._stream_searched = 0  # characters of stable text searched before streaming it
        self._stream_stop: int | None = None  # where the first stop string in the stable text begins
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

    # -- output ---------------------------------------------------------------------------
    def commit(self, ev: Committed) -> tuple[Committed, str]:
        """Add the tokens of one `Committed` event of this request to its output and text, and
        end the text at the first stop string: the token that completes one is the output's last
        (``stop_hit`` names the string; the engine ends the request with ``"stop"``). Inside a
        forced output (`RequestConfig.forced`) no stop string ends it. A token that ended the
        request by its id (``ev.stop_token``) is in the tokens, not in the text. Called by the
        engine under its lock, once per event of this request, in order.

        Args:
            ev: the event; its ``tokens`` in order, written by ``ev.model`` (with models that
                do not share a tokenizer, it picks the vocabulary).

        Returns:
            ``(event, text)``: the event as far as it belongs to the output (cut after a stop
            string's last token, with ``last`` set; else ``ev`` itself) and the new text that is
            safe to stream: stable, before any stop string and not possibly the start of one,
            or up to the final text's end when the request ends with these tokens ("" when none,
            or without a tokenizer).
        """
        ids = ev.tokens[:-1] if ev.last and ev.stop_token else ev.tokens
        n = len(ev.tokens)
        if self.detok is not None and self.stops is not None:
            cut = self._until_stop(ids, ev.model)
            if cut is not None:
                n = cut
                ev = dataclasses.replace(
                    ev,
                    tokens=ev.tokens[:n],
                    last=True,
                    logprobs=None if ev.logprobs is None else ev.logprobs[:n],
                    chars=ev.chars if n == len(ev.tokens) else None,
                    units=ev.units if n == len(ev.tokens) else None,
                    stop_token=False,
                )
        elif self.detok is not None and ids:  # nobody streams: decoded once at the end
            (self.detok.extend if self.call.listener is None else self.detok.add)(ids, ev.model)
        self._extend_output(ev)
        return ev, self._release(ev.last)

    def _extend_output(self, ev: Committed) -> None:
        out = self.output
        out.token_ids.extend(ev.tokens)
        out.token_models.extend([ev.model] * len(ev.tokens))
        if out.logprobs is not None and ev.logprobs is not None:
            out.logprobs.extend(lp for lp, _ in ev.logprobs)
            if out.top_logprobs is not None:
                out.top_logprobs.extend(dict(top) for _, top in ev.logprobs)

    def _until_stop(self, ids: list[int], model: str) -> int | None:
        """Decode ``ids`` one at a time and search each new character for a stop string (past
        the forced output); the number of ``ids`` up to the one that completes one, or None."""
        base, forced = len(self.output.token_ids), len(self.config.forced)
        for j, tok in enumerate(ids):
            self.detok.add([tok], model)
            if base + j + 1 <= forced:
                continue
            text = self.detok.peek()
            hit = self.stops.find(text, self._searched)
            self._searched = len(text)
            if hit is not None:
                self.stop_hit = hit[1]
                return j + 1
        return None

    def _release(self, last: bool) -> str:
        """The text that became safe to stream (all of the final text with ``last``)."""
        if self.detok is None:
            return ""
        if last:
            return self.take_text(len(self.finalize_text()))
        if self.call.listener is None:  # nobody streams
            return ""
        text = self.detok.text
        limit = len(text)
        if self.stops is not None:
            if self._stream_stop is None:  # the stable text only grows: search only what is new
                hit = self.stops.find(text, self._stream_searched)
                self._stream_searched = len(text)
                self._stream_stop = hit[0] if hit else None
            limit = self._stream_stop if self._stream_stop is not None else len(text) - self.stops.held(text)
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
