"""How a sub-server takes requests in and lets them go: admission (`Admit`), the admission
prefill of a peer (`Prefill`), a handoff received (`HandoffMsg`: the suffix this model has not
seen, or for models that do not share a tokenizer the bytes, re-encoded with `retokenize`), the
policy's ``receive`` hook before this model owns it, `Release` (the request ended elsewhere: free
its KV) and `Abort` (end it here, or remember its id for a handoff still in flight).

`Arrivals` is a part of `SubServer` (its base class): it reads and sets the sub-server's
``sched``, ``aborted``, ``host``, ``text``, ``runner``, ``index``, ``name`` and ``clock`` and
reports through its ``_emit``, ``_send`` and ``_finish``.
"""

from __future__ import annotations

from .. import messages
from .sampler import make_generator
from .scheduler import RequestState, Seq
from .text_mode import TextView, retokenize

ABORTED_KEPT = 65536  # aborted request ids remembered for handoffs still in flight


class Arrivals:
    """The message handlers of `SubServer` that bring a request in or let it go (see the
    module docstring)."""

    def _admit(self, msg: messages.Admit) -> None:
        cfg = msg.config
        prompt = cfg.prompt_of(self.name)
        seen = dict.fromkeys([*msg.peers, self.name], len(prompt))
        request_state = RequestState(
            seen=seen, state=msg.state, seen_bytes={self.name: 0} if self.text is not None else {}
        )
        seq = Seq(
            cfg,
            list(prompt),
            request_state,
            generator=make_generator(cfg.params.seed, self.index, self.runner.device),
            prompt_len=len(prompt),
            text=TextView() if self.text is not None else None,
        )
        seq.reuse = not self.host.needs(cfg.policy_key, "prompt_hidden")
        if cfg.rid in self.aborted:
            self._end_aborted(seq)
        else:
            self._own(seq)

    def _release(self, msg: messages.Release) -> None:
        self.sched.remove(msg.rid)
        self.aborted.pop(msg.rid, None)  # it ended: no handoff of it can follow

    def _prefill(self, msg: messages.Prefill) -> None:
        """Admission prefill of a peer: feed the prompt in a coming step, then keep it pending.
        One that cannot run here (aborted, too big for the pool) is skipped: a later handoff
        carries the config and prefills on arrival."""
        cfg = msg.config
        if cfg.rid in self.aborted or cfg.rid in self.sched.seqs:
            return
        prompt = cfg.prompt_of(self.name)
        n = len(prompt)
        seq = Seq(
            cfg,
            list(prompt),
            RequestState(seen={msg.entry: n, self.name: n}),
            prefill_only=True,
            generator=make_generator(cfg.params.seed, self.index, self.runner.device),
            prompt_len=n,
            text=TextView() if self.text is not None else None,
        )
        if not self.sched.too_big(seq):
            self.sched.add_owned(seq)

    def _abort(self, msg: messages.Abort) -> None:
        self.aborted[msg.rid] = (msg.reason, msg.error)
        while len(self.aborted) > ABORTED_KEPT:
            self.aborted.popitem(last=False)
        seq = self.sched.owned.get(msg.rid)
        if seq is not None and seq.prefill_only:  # not ours to report: the owner does; a late handoff finds the mark
            self.sched.remove(msg.rid)
        elif seq is not None:
            self._end_aborted(seq)
        else:
            self.sched.remove(msg.rid)  # pending here (or unknown): free its KV

    def _end_aborted(self, seq: Seq) -> None:
        reason, error = self.aborted.pop(seq.rid, ("aborted", "aborted by the user"))
        self.sched.seqs[seq.rid] = seq
        self._finish(seq, reason, error)

    def _own(self, seq: Seq) -> None:
        if self.sched.too_big(seq):
            self.sched.seqs[seq.rid] = seq
            self._finish(seq, "failed", self.sched.kv_error(seq, self.name))
            return
        self.sched.add_owned(seq)

    def _receive(self, msg: messages.HandoffMsg) -> None:
        seq = self.sched.seqs.get(msg.rid)
        if seq is None and msg.config is None:  # our KV of it was freed by an abort meanwhile
            if msg.rid in self.aborted:
                reason, error = self.aborted.pop(msg.rid)
                self._emit(messages.Finished(msg.rid, self.name, reason, error, self.clock()))
                for m, n in msg.request.seen.items():
                    if m != self.name and n > 0:
                        self._send(m, messages.Release(msg.rid))
            return
        if self.text is not None:
            self._receive_text(seq, msg)
            return
        if seq is None:
            known = msg.request.seen[self.name] - len(msg.suffix)  # > 0: the source counted on an admission prefill
            seq = Seq(
                msg.config,
                list(msg.config.prompt_ids[:known]),
                generator=make_generator(msg.config.params.seed, self.index, self.runner.device),
            )
        seq.prefill_only = False
        seq.tokens.extend(msg.suffix)
        if seq.kv_len >= len(seq.tokens):  # peer discarded and bounced back: recompute the last position
            self.sched.rewind(seq, len(seq.tokens) - 1)
        seq.request_state, seq.resamples = msg.request, 0
        if msg.rid in self.aborted:
            self._end_aborted(seq)
            return
        if len(seq.tokens) != msg.request.seen[self.name]:
            self.sched.seqs[seq.rid] = seq
            self._finish(
                seq,
                "failed",
                f"internal error: model '{self.name}' holds {len(seq.tokens)} "
                f"tokens of request {seq.rid}, the handoff says {msg.request.seen[self.name]}",
            )
            return
        bad = [t for t in msg.suffix if not 0 <= t < self.runner.vocab_size]
        if bad:
            self.sched.seqs[seq.rid] = seq
            self._finish(
                seq,
                "failed",
                f"model '{msg.src}' wrote token id {bad[0]}, outside model '{self.name}'s "
                f"vocabulary [0, {self.runner.vocab_size}); the models must share one tokenizer",
            )
            return
        self._take_over(seq, msg)

    def _receive_text(self, seq: Seq | None, msg: messages.HandoffMsg) -> None:
        """A handoff between models that do not share a tokenizer: encode the committed bytes
        this model has not seen (``msg.data``) in its tokens, re-encoding the end of its view as
        far back as the token boundary requires (`TextView.receive`); rewind the KV to the first
        token that changed, so the next step feeds the rest."""
        if seq is None:
            prompt = msg.config.prompt_of(self.name)
            seq = Seq(
                msg.config,
                list(prompt),
                generator=make_generator(msg.config.params.seed, self.index, self.runner.device),
                prompt_len=len(prompt),
                text=TextView(),
            )
        seq.prefill_only = False
        kv = seq.kv_len
        retokenize(seq, self.text.vocab, msg.data, self.sched)
        seq.request_state, seq.resamples = msg.request, 0
        self._emit(
            messages.Retokenized(
                seq.rid, self.name, max(0, kv - seq.kv_len), len(seq.tokens) - seq.kv_len, len(seq.tokens), self.clock()
            )
        )
        if msg.rid in self.aborted:
            self._end_aborted(seq)
            return
        if len(seq.tokens) >= self.runner.max_context:
            self.sched.seqs[seq.rid] = seq
            self._finish(seq, "length", None)
            return
        self._take_over(seq, msg)

    def _take_over(self, seq: Seq, msg: messages.HandoffMsg) -> None:
        """The policy's ``receive`` hook, then this model owns ``seq``."""
        error = self.host.receive(seq, msg.keep_sampled)
        if error is not None:
            self.sched.seqs[seq.rid] = seq
            self._finish(seq, "failed", *error)
            return
        self._own(seq)
