"""A sub-server: everything that serves one model.

It owns a scheduler, a runner with its private KV storage and the block allocator over it, and
the `PolicyHost` that runs the policies of the requests it owns. It learns about requests only
from messages (`Admit`, `HandoffMsg`, `Release`, `Abort`: their handlers are `arrivals.Arrivals`,
its base class) and reports only through events (`Committed`, `Hopped`, `Finished`, `StepDone`),
so the same loop runs in a thread, in a process or in simulated time.

One step (`SubServer.step`): schedule a batch (prefill, decode and extend mixed), one forward
(`forward_each`), mask the vocabulary to the tokenizer's, sample (greedily after a
``Handoff(greedy=True)``), take each request's decision from the policy host (it may set the
token written, or `Resample` it: a new draw from the same distribution, routed again), then
commit (`commit_rules`: the stop rules) or hand off (the request stays pending here, KV kept).
Requests prefilled at admission for a later handoff (`Prefill`, ``EngineConfig.prefill_peers``)
are fed and then wait pending, unrouted.

Models that do not share a tokenizer (``text``, a `TextMode`): the committed output is bytes
(`TextView`); a handoff carries the bytes the target has not seen; a receipt re-encodes the end
of this model's tokens of the text with them, rewinds the KV to the first token that changed and
feeds from there (a `Retokenized` event says how many); docs/mixed-vocabularies.md.

A sub-server is a step machine and knows no transport: feed it messages (`SubServer.handle`),
call `SubServer.step`, and read the `StepResult` it returns (the events for the engine in
order, then the messages for peers). `serve_loop.serve` is the loop the thread and process
transports run around it; the sim transport drives the same two calls in simulated time.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import traceback
from typing import Callable

import torch

from ...policy import Handoff
from ...request import SamplingParams
from .. import messages
from ..config import MODES, EngineConfig, Mode
from ..runner import SeqInput
from ..step_result import StepResult, UnknownMessage, dispatch
from .arrivals import Arrivals
from .block_allocator import blocks_of
from .commit_rules import commit_text, commit_token, given_tokens, logprobs
from .forward import forward_each
from .policy_host import PolicyHost, RequestFailed
from .sampler import sample
from .scheduler import Scheduler, Seq
from .text_mode import TextMode

GREEDY = SamplingParams()  # how a request samples after a Handoff(greedy=True)
TEXT_CACHE_HOLD = 8  # models without one tokenizer: a request's last tokens stay out of the prefix cache

__all__ = ["SubServer", "StepResult", "UnknownMessage", "RequestFailed", "MODES", "Mode"]


class SubServer(Arrivals):
    """Serves one model.

    Args:
        name: model name (e.g. ``"small"``).
        models: all model names, smallest first.
        runner: the model's `tokenrouter_sdk.engine.runner.Runner` (owns the KV storage; its
            ``pool`` gives the geometry the block ids are allocated over: `blocks_of`).
        tokenizer: the model's tokenizer, shared by every model unless ``text`` is given (stop
            strings; ``step.tokenizer`` for policies).
        config: the `EngineConfig` (mode, retain_kv, batch limits, ...).
        thresholds: delayed batching thresholds B_i per model (``delayed`` mode).
        vocab_limit: token ids at or above it are never sampled (the shared tokenizer's size:
            a model's extra logits rows, e.g. Qwen's padding to 151,936, are cut off).
        clock: seconds; ``time.perf_counter`` (or a simulated clock for the sim backend).
        text: models that do not share a tokenizer: this model's `TextMode` (its byte table,
            the unit model's, its EOS ids, the ids it never writes); None for one tokenizer.

    Not thread-safe: one thread calls `handle`, `take` and `step`.
    """

    def __init__(
        self,
        name: str,
        models: list[str],
        runner,
        tokenizer,
        config: EngineConfig,
        thresholds: dict[str, int] | None = None,
        vocab_limit: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        text: TextMode | None = None,
    ):
        self.name, self.models, self.index = name, list(models), list(models).index(name)
        self.text = text
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.sched = Scheduler(
            blocks_of(runner),
            config.max_batch_tokens,
            config.max_batch_size,
            prefix_cache=config.prefix_cache,
            cache_hold=TEXT_CACHE_HOLD if text is not None else 0,
        )
        self.host = PolicyHost(name, models, tokenizer)
        self.policies = self.host.policies  # key -> Policy, registered by RegisterPolicy
        self.aborted: collections.OrderedDict[int, tuple[str, str | None]] = collections.OrderedDict()
        self._running = True
        self.mode, self.retain_kv = config.mode, config.retain_kv
        self.thresholds = dict(thresholds or {})
        self.vocab_limit = int(vocab_limit or runner.vocab_size)
        banned = [i for i in (text.banned if text is not None else ()) if i < self.vocab_limit]
        self._banned = torch.tensor(banned, dtype=torch.long) if banned else None
        self.inflight = 0
        self._go_rounds: list[int] = []
        self._out = StepResult()  # what handling and stepping produced since the last take/step
        self._late_finishes: list | None = None  # inside a step: its Finished events, placed after its StepDone
        self.clock = clock
        self._may_step = (
            (lambda: bool(self._go_rounds))
            if self.mode.gated
            else self.delayed_ok
            if self.mode.batches_delayed
            else (lambda: bool(self.sched.owned))
        )
        self._handlers = {
            messages.Admit: self._admit,
            messages.Prefill: self._prefill,
            messages.HandoffMsg: self._receive,
            messages.Release: self._release,
            messages.Abort: self._abort,
            messages.Shutdown: self._shutdown,
            messages.RegisterPolicy: lambda m: self.host.add(m.key, m.policy),
            messages.UnregisterPolicy: lambda m: self.host.remove(m.key),
            messages.Go: lambda m: self._go_rounds.append(m.round),
            messages.SetInflight: self._set_inflight,
            messages.SetThresholds: self._set_thresholds,
            messages.StatsQuery: lambda m: self._emit(self.stats(m.token)),
            messages.ClearPrefixCache: lambda m: self.sched.blocks.clear_prefix_cache(),
        }

    @property
    def running(self) -> bool:
        """False once a `Shutdown` was handled."""
        return self._running

    def _emit(self, event) -> None:
        self._out.events.append(event)

    def _send(self, model: str, msg) -> None:
        self._out.messages.append((model, msg))

    def take(self) -> StepResult:
        """What the messages handled since the last `take` or `step` produced (events, then
        messages for peers), without stepping."""
        res, self._out = self._out, StepResult()
        return res

    # -- message handling -----------------------------------------------------------------
    def handle(self, msg) -> None:
        """Apply one message from the engine or a peer; what it produces (e.g. the `Finished`
        of a request aborted meanwhile, a `Stats` answer) is in the next `take` or `step`.

        Raises:
            UnknownMessage: ``msg`` is not a message a sub-server knows (names its type).
        """
        dispatch(self._handlers, msg, f"sub-server '{self.name}'")

    def _shutdown(self, msg: messages.Shutdown) -> None:
        self._running = False

    def _set_inflight(self, msg: messages.SetInflight) -> None:
        self.inflight = msg.n

    def _set_thresholds(self, msg: messages.SetThresholds) -> None:
        self.thresholds = dict(msg.thresholds)

    def stats(self, token: int = 0) -> messages.Stats:
        """This sub-server's KV pool and request counts, as a `Stats` event (`Scheduler.stats`)."""
        return self.sched.stats(self.name, token)

    # -- the loop -------------------------------------------------------------------------
    def delayed_ok(self) -> bool:
        """Delayed batching (TokenRouter paper, "delayed batching"): launch when at least B_i
        requests are ready here. Tail rule: when the thresholds are infeasible for the requests
        still in flight (sum_j (B_j - 1) >= inflight), launch as soon as one is ready, so no
        workload tail can deadlock."""
        ready = len(self.sched.owned)
        if ready == 0:
            return False
        if sum(b - 1 for b in self.thresholds.values()) >= self.inflight:
            return True
        return ready >= self.thresholds.get(self.name, 1)

    def can_step(self) -> bool:
        """Whether `step` would run a step now (the mode's rule, chosen once: a `Go` in gated
        modes, the delayed batching rule in ``delayed``, any owned request otherwise)."""
        return self._running and self._may_step()

    def step(self) -> StepResult:
        """Run at most one step (when `can_step`): schedule a batch, forward, sample, route,
        commit or hand off. Returns everything produced since the last `take` or `step`: the
        events in order (a step's per-request events, its `StepDone`, then the `Finished` of the
        requests it ended; a gated round with nothing to run gives `Idle`) and the messages for
        peers (handoffs, releases). ``ran`` says whether a forward ran.

        Raises:
            RunnerDied: the runner can serve no more steps (the sub-server must stop).
        """
        if self.can_step():
            self._out.ran = self._step_once()
        return self.take()

    def _step_once(self) -> bool:
        rnd = self._go_rounds.pop(0) if self.mode.gated else None
        pre = self.sched.preemptions
        batch = self.sched.schedule()
        for seq in self.sched.unfit:
            self._finish(seq, "failed", self.sched.kv_error(seq, self.name))
        if batch:
            self._late_finishes = []
            try:
                self._step(batch, self.sched.preemptions - pre, rnd)
            finally:
                late, self._late_finishes = self._late_finishes, None
                self._out.events.extend(late)
            return True
        if rnd is not None:
            self._emit(messages.Idle(self.name, rnd))
        return False

    def _wants_prompt_hidden(self, s: Seq) -> bool:
        """Whether this step must keep every prompt position's hidden state of ``s``: its first
        step (on its entry model, from position 0) under a policy with ``Needs(prompt_hidden)``."""
        if s.prefill_only or s.request_state.hops or s.request_state.n_committed or s.kv_len:
            return False
        return self.host.needs(s.config.policy_key, "prompt_hidden")

    def _forward(self, batch: list[Seq]) -> tuple[list[Seq], torch.Tensor | None, torch.Tensor | None, list]:
        """The forward (`forward_each`: a request whose own inputs fail fails alone). Returns the
        requests that ran, their logits and hidden states, and per request the hidden states of
        every fed position where asked (else None)."""
        inputs = [
            SeqInput(s.tokens[s.kv_len :], s.kv_len, s.table, all_hidden=self._wants_prompt_hidden(s)) for s in batch
        ]
        ok, logits, hidden, fed, failed = forward_each(self.runner, inputs)
        for i, e in failed:
            self._fail_forward(batch[i], e)
        return [batch[i] for i in ok], logits, hidden, fed

    def _fail_forward(self, s: Seq, e: Exception) -> None:
        s.kv_len = 0
        if s.prefill_only:  # an admission prefill: skip it (a handoff here prefills on arrival)
            self.sched.remove(s.rid)
            return
        self._finish(s, "failed", f"forward of model '{self.name}' failed for request {s.rid}: {type(e).__name__}: {e}")

    def _step(self, batch: list[Seq], preempted: int, go_round: int | None) -> None:
        t0 = self.clock()
        fed = {s.rid: len(s.tokens) - s.kv_len for s in batch}
        batch, logits, hidden, fed_hidden = self._forward(batch)
        ran = bool(batch)
        if batch:
            for s in batch:
                s.kv_len = len(s.tokens)
            self.sched.cache_blocks(batch)
            keep = [i for i, s in enumerate(batch) if not s.prefill_only]
            for s in batch:
                if s.prefill_only:  # prompt now in KV: wait for the first handoff
                    self.sched.set_pending(s)
            if len(keep) < len(batch):
                rows = torch.tensor(keep, dtype=torch.long)
                batch, logits, hidden = [batch[i] for i in keep], logits[rows], hidden[rows]
                fed_hidden = [fed_hidden[i] for i in keep]
        if batch:
            if logits.shape[-1] > self.vocab_limit:
                logits = logits[:, : self.vocab_limit]
            if self._banned is not None:  # tokens writing bytes a peer's vocabulary cannot spell
                logits = logits.index_fill(1, self._banned.to(logits.device), float("-inf"))
            prompt_hidden = [None if h is None else h[: s.prompt_len] for s, h in zip(batch, fed_hidden)]
            tokens = self._sample(batch, logits, range(len(batch)))
            decisions = self.host.decide(
                batch,
                tokens,
                logits,
                hidden,
                prompt_hidden,
                lambda idx: self._sample(batch, logits, idx),
                self._resampled,
                self.config.max_hops_without_commit,
            )
            for s in batch:
                s.request_state.peer_logits = None  # read by this step's route only
            for i, (s, tok, dec) in enumerate(zip(batch, tokens, decisions)):
                if isinstance(dec, RequestFailed):
                    self._finish(s, "failed", *dec.args)
                    continue
                try:
                    self._apply(s, tok, dec, logits, i)
                except RequestFailed as e:
                    self._finish(s, "failed", *e.args)
                except Exception as e:  # noqa: BLE001 - never let one request stop the sub-server
                    if s.rid in self.sched.seqs:
                        self._finish(
                            s,
                            "failed",
                            f"internal error while applying the decision {dec!r} of policy "
                            f"{self.host.name(s)} to request {s.rid} on model '{self.name}': "
                            f"{type(e).__name__}: {e}",
                            "".join(traceback.format_exception(type(e), e, e.__traceback__)),
                        )
        blocks, owned = self.sched.blocks, self.sched.owned
        pending = sum(len(s.table) for r, s in self.sched.seqs.items() if r not in owned)
        self._emit(
            messages.StepDone(
                model=self.name,
                t_start=t0,
                t_end=self.clock(),
                forward_s=self.runner.last_forward_s if ran else 0.0,
                batch_size=len(fed),
                tokens_fed=sum(fed.values()),
                fed=fed,
                preempted=preempted,
                round=go_round,
                kv_used_blocks=blocks.num_blocks - blocks.num_free,
                queued=max(0, len(owned) - len(batch)),
                kv_pending_blocks=pending,
                cache_hit_tokens=self.sched.hit_tokens,
                cache_query_tokens=self.sched.query_tokens,
                kv_cached_blocks=blocks.cached_blocks,
            )
        )

    def _sample(self, batch: list[Seq], logits: torch.Tensor, idx) -> list[int]:
        """A token per request of ``batch`` at rows ``idx`` (greedy after ``Handoff(greedy=True)``)."""
        idx = list(idx)
        rows = logits if len(idx) == len(batch) else logits[torch.tensor(idx, dtype=torch.long)]
        params = [GREEDY if batch[i].request_state.greedy else batch[i].config.params for i in idx]
        tokens = sample(rows, params, [batch[i].generator for i in idx]).tolist()
        return given_tokens(batch, tokens, idx)

    def _resampled(self, s: Seq, tok: int) -> None:
        self._emit(messages.Resampled(s.rid, self.name, tok, s.request_state.n_committed, self.clock()))

    def _apply(self, s: Seq, tok: int, target: str, logits: torch.Tensor, row: int) -> None:
        lp = None if s.config.params.logprobs is None else logprobs(logits[row], tok, s.config.params.logprobs)
        if s.request_state.span is not None:  # forced span on the peer (e.g. R2R: the large model writes 1 token)
            s.request_state.span -= 1
            if self._commit(s, tok, lp) or target == self.name:
                return
            self._handoff(s, target, Handoff(keep_sampled=True), committed=True)
            return
        if target == self.name:
            self._commit(s, tok, lp)
            return
        h = self.host.send(s, target)
        if h.keep_sampled:
            if self._commit(s, tok, lp):
                return
        else:
            s.request_state.discarded += 1
        peer = None
        if not h.keep_sampled and self.host.needs(s.config.policy_key, "handoff_logits"):
            peer = logits[row].detach().cpu()  # only here: a torch op lets peer threads run
        self._handoff(s, target, h, committed=h.keep_sampled, token=None if h.keep_sampled else tok, peer_logits=peer)

    def _commit(self, s: Seq, tok: int, lp: tuple | None = None) -> bool:
        """Commit ``tok`` (``lp``: its log-probabilities, `logprobs`); return True if the request
        finished (`commit_token`, `commit_text`: the stop rules but stop strings, which the engine
        finds in the text)."""
        chars = units = why = None
        if self.text is not None:
            reason, chars, units = commit_text(self.text, s, tok, self.name, self.runner.max_context)
        else:
            reason, why = commit_token(s, tok, self.name, self.runner.max_context)
        self._emit(
            messages.Committed(
                s.rid,
                self.name,
                [tok],
                self.clock(),
                reason is not None,
                None if lp is None else [lp],
                chars=chars,
                units=units,
                stop_token=reason in ("stop", "eos"),
            )
        )
        if reason:
            self._finish(s, reason, None, stop_reason=why)
            return True
        return False

    def _handoff(
        self,
        s: Seq,
        target: str,
        h: Handoff,
        committed: bool,
        token: int | None = None,
        peer_logits: torch.Tensor | None = None,
    ) -> None:
        s.request_state.hops += 1
        s.request_state.hops_since_commit = 0 if committed else s.request_state.hops_since_commit + 1
        self.host.check_hops(s, self.config.max_hops_without_commit)
        t_seen = s.request_state.seen.get(target, 0)
        seen = dict(s.request_state.seen)
        seen[target] = len(s.tokens)
        seen_bytes = dict(s.request_state.seen_bytes)
        self._emit(messages.Hopped(s.rid, self.name, target, committed, self.clock(), token))
        if self.text is not None:  # the committed bytes the target has not seen
            b_seen = seen_bytes.get(target)
            seen_bytes[target] = s.request_state.n_bytes
            suffix, data = [], bytes(s.text.data[b_seen or 0 :])
            config = s.config if b_seen is None else None
        else:
            suffix, data = s.tokens[t_seen:], b""
            config = s.config if t_seen <= len(s.config.prompt_ids) else None
        travels = dataclasses.replace(
            s.request_state,
            seen=seen,
            span=h.span,
            return_to=self.name if h.span is not None else None,
            greedy=bool(h.greedy),
            peer_logits=peer_logits,
            seen_bytes=seen_bytes,
        )
        msg = messages.HandoffMsg(s.rid, self.name, suffix, travels, h.keep_sampled, config=config, data=data)
        s.request_state = dataclasses.replace(
            s.request_state,
            seen=dict(seen),
            span=None,
            return_to=None,
            greedy=False,
            peer_logits=None,
            seen_bytes=dict(seen_bytes),
        )
        s.resamples = 0
        self.sched.set_pending(s)
        if not self.retain_kv:  # baseline: forget the KV, the return re-prefills (what the prefix cache lacks)
            self.sched.drop_kv(s)
        self._send(target, msg)

    def _finish(self, s: Seq, reason: str, error: str | None, tb: str | None = None, stop_reason=None) -> None:
        ev = messages.Finished(s.rid, self.name, reason, error, self.clock(), stop_reason, tb)
        if self._late_finishes is not None:
            self._late_finishes.append(ev)  # so a request's last step is in the trace before it ends
        else:
            self._emit(ev)
        for m, n in s.request_state.seen.items():
            if m != self.name and n > 0:
                self._send(m, messages.Release(s.rid))
        self.sched.remove(s.rid)
