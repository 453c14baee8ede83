"""The engine: admission, per-request outputs and text, calls, abort, and the event trace.

It starts one `SubServer` per model (through a transport), sends each admitted request to its
entry model, and turns the sub-servers' events into `RequestOutput`s. Work arrives as a
`Call`: a batch of requests with its own policy and concurrency limit, its own events (its
trace) and its own end. The engine keeps a call only while it runs: once every request of a
call has ended, the call (held by its caller) is the only place its outputs and events live,
so memory does not grow with the requests served.

Everything the Router, the planner, the views and a server need goes through this API:
`Engine.submit` / `Call.wait` / `Call.abort` / `Call.metrics`, `Engine.abort`,
`Engine.kv_stats`, `Engine.add_observer`, `Engine.close`.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence

from ...policy import Policy
from ...request import RequestConfig, RequestInput, RequestView, prompt_key, token_ids
from .. import messages
from ..config import EngineConfig, valid_thresholds
from ..core.policy_host import PolicyHost, check_policy, check_vocabulary
from ..core.text_mode import Vocabularies
from ..runner import RemoteRunner, RunnerInfo, RunnerSpec
from ..step_result import dispatch
from ..transports.transport import ThreadTransport
from .admission import KVReservation
from .call import Call
from .request_handle import RequestHandle

RECENT_EVENTS = 4096  # events kept engine-wide for the planner's history and Router-wide views


class EngineDeadError(RuntimeError):
    """A sub-server is dead: the engine cannot serve new requests (names the model and why)."""


class Engine:
    """Runs requests across per-model sub-servers.

    Args:
        runners: model name -> runner (smallest model first): a
            `tokenrouter_sdk.engine.runner.Runner` object (it travels to its sub-server as it
            is), or a `tokenrouter_sdk.engine.runner.RunnerSpec` (built where its sub-server
            runs: the sub-server thread, process or Ray actor).
        tokenizer: the shared tokenizer (text, stop strings, EOS id); with ``text``, the unit
            model's.
        config: the `EngineConfig`.
        transport: how sub-servers run and talk (`ThreadTransport` by default; `SimTransport`
            for the sim backend, `ProcessTransport` for processes).
        eos_ids: token ids that end a request besides the tokenizer's EOS (e.g. every model's
            ``generation_config.eos_token_id``).
        text: models that do not share a tokenizer: their `Vocabularies` (each sub-server gets
            its model's tokenizer and `TextMode`; the output text is made from bytes). None: one
            shared tokenizer.

    Attributes:
        info: per model, its `tokenrouter_sdk.engine.runner.RunnerInfo` (what the engine plans
            with: vocabulary, context, KV geometry), read once from each runner or spec given; a
            sub-server that reports its runner built otherwise fails the start.
        runners: per model, for inspection: its runner where it lives in this process (a runner
            object given, or one a thread transport built from its spec, as the transport hands
            it out), else a `tokenrouter_sdk.engine.runner.RemoteRunner` (what this process knows
            of a runner built in another process: vocabulary, context, device, dtype, pool shape,
            settings). The engine itself never reads them.

    Raises:
        ValueError: thresholds naming unknown models or below 1.
        RuntimeError: a sub-server reported its runner's vocabulary, context or KV geometry
            other than its spec described (names the model and both).
        Exception: what describing or building a runner from its spec raised (e.g.
            `UnsupportedAttention`, out of memory for a KV pool).
    """

    def __init__(
        self,
        runners: dict,
        tokenizer,
        config: EngineConfig | None = None,
        *,
        transport=None,
        eos_ids: Sequence[int] = (),
        text: Vocabularies | None = None,
    ):
        self.config = config or EngineConfig()
        self.models = list(runners)
        self.info = {m: RunnerInfo.of(r) for m, r in runners.items()}
        self._views = {m: RemoteRunner(r, self.info[m]) if isinstance(r, RunnerSpec) else r for m, r in runners.items()}
        self.tokenizer, self.text = tokenizer, text
        tok_eos = token_ids(getattr(tokenizer, "eos_token_id", None))
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in [*tok_eos, *eos_ids]))
        if text is not None:  # per model: its logits rows up to its own tokenizer's size
            self.vocab_limits = {m: min(int(i.vocab_size), len(text.tokenizers[m])) for m, i in self.info.items()}
        else:
            vocabs = [int(i.vocab_size) for i in self.info.values()]
            limit = min(vocabs + ([len(tokenizer)] if tokenizer is not None else []))
            self.vocab_limits = dict.fromkeys(self.models, limit)
        self.vocab_limit = self.vocab_limits[self.models[-1]]
        self.max_context = min(int(i.max_context) for i in self.info.values())
        self.capacity = {m: (i.pool.num_blocks, i.pool.block_size) for m, i in self.info.items()}
        self.thresholds = self.config.threshold_map(self.models)
        self.recent: collections.deque = collections.deque(maxlen=RECENT_EVENTS)
        self.handles: dict[int, RequestHandle] = {}  # requests not ended
        self._lock = threading.RLock()
        self._calls: list[Call] = []  # calls with requests not ended, in submission order
        self._inflight = 0
        self.kv = KVReservation(self.capacity, self.max_context, self.config.prefix_cache)  # under _lock
        self._next_rid = 0
        self._policies: dict[int, list] = {}  # key -> [policy, calls using it]
        self.host = PolicyHost("", self.models)  # runs entry and may_use at submission
        self._next_key = 0
        self._observers: list[Callable[[object], None]] = []
        self._dead: dict[str, str] = {}
        self._closed = False
        self._stats: dict[int, dict] = {}
        self._stats_cv = threading.Condition(self._lock)
        self._event_handlers = {
            messages.StepDone: self._on_step_done,
            messages.Idle: self._on_idle,
            messages.Stats: self._on_stats,
            messages.ModelDied: self._on_died,
            messages.Committed: self._on_committed,
            messages.Hopped: self._on_hopped,
            messages.Resampled: self._on_resampled,
            messages.Finished: self._on_finished,
            messages.Retokenized: self._on_retokenized,
        }
        self._next_token = 0
        self._round, self._awaiting, self._next_target = 0, set(), 0
        self._done_waiters: dict[int, list[Callable[[], None]]] = {}
        self.transport = transport if transport is not None else ThreadTransport()
        self.clock = self.transport.clock
        specs = {
            name: dict(
                name=name,
                models=self.models,
                runner=r,
                config=self.config,
                thresholds=self.thresholds,
                vocab_limit=self.vocab_limits[name],
                **(
                    dict(tokenizer=text.tokenizers[name], text=text.mode(name))
                    if text is not None
                    else dict(tokenizer=tokenizer)
                ),
            )
            for name, r in runners.items()
        }
        self.transport.start(specs, self.handle_event)
        self._check_reported()

    @property
    def runners(self) -> dict:
        """Per model, its runner for inspection (see the class docstring)."""
        out = {}
        for m, view in self._views.items():
            built = self.transport.local_runner(m) if isinstance(view, RemoteRunner) else None
            out[m] = built if built is not None else view
        return out

    def _check_reported(self) -> None:
        """Compare what each sub-server reported of its built runner (the transport's
        ``reported()``) with what the engine plans with; a difference closes the engine."""
        for m, got in self.transport.reported().items():
            want = self.info[m].geometry()
            if got != want:
                self.transport.close()
                raise RuntimeError(
                    f"model '{m}': its runner was built as {got} in its sub-server, but its spec "
                    f"described {want}; the engine sizes admission, vocabulary and context from "
                    f"the spec, so its describe() must say what build() makes"
                )

    # -- policies ---------------------------------------------------------------------------
    def _register(self, policy: Policy) -> int:
        """The key of ``policy`` in every sub-server, sent (again) for this call: a policy edited
        since the last call reaches sub-server processes as it is now."""
        with self._lock:
            key = next((k for k, (p, _) in self._policies.items() if p is policy), None)
            if key is None:
                key = self._next_key
                self._next_key += 1
                self._policies[key] = [policy, 0]
            self._policies[key][1] += 1
        msg = messages.RegisterPolicy(key, policy)
        for name in self.models:
            self.transport.send(name, msg)
        return key

    def _unregister(self, key: int) -> None:
        entry = self._policies.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._policies[key]
            for name in self.models:
                self.transport.send(name, messages.UnregisterPolicy(key))

    # -- submission -------------------------------------------------------------------------
    def submit(
        self,
        requests: Sequence[RequestInput],
        policy: Policy,
        *,
        concurrency: int | None = None,
        listener: Callable[[str, RequestHandle, object], None] | None = None,
    ) -> Call:
        """Queue a batch of requests routed by ``policy``; returns its `Call` at once.

        Args:
            requests: the requests (`RequestInput`: prompt ids, sampling, key; one with
                ``error`` set ends ``failed`` with it, without running).
            policy: the `Policy` of these requests.
            concurrency: requests of this call in flight at most (None: no own limit).
            listener: ``listener(kind, handle, payload)``, called from the engine's thread for
                ``"tokens"`` (payload: (`Committed`, newly stable text)), ``"hop"`` (`Hopped`)
                and ``"finish"`` (the last text piece) of this call's requests.

        Raises:
            RuntimeError: the engine is closed.
            EngineDeadError: a sub-server is dead (names it and why).
            ValueError: ``concurrency < 1``.
            TypeError: ``policy`` is not a `Policy` instance (e.g. the class itself) or its
                ``needs`` is not a `Needs` (`tokenrouter_sdk.engine.core.policy_host.check_policy`).
            ValueError: a policy that needs one vocabulary for models that do not share a
                tokenizer (`tokenrouter_sdk.engine.core.policy_host.check_vocabulary`).

        A policy hook (``entry``, ``may_use`` here; ``route``, ``send``, ``receive`` on the
        sub-servers) that raises or returns a value it may not fails only its request, with an
        error naming the policy, the hook, the value and what is accepted.
        """
        self._check_open(concurrency)
        check_policy(policy)
        check_vocabulary(policy, self.models, self.text is not None)
        key = self._register(policy)
        call = Call(self, concurrency, key, listener)
        seen: collections.Counter = collections.Counter()
        handles = [self._new_handle(i, req, policy, call, key, seen) for i, req in enumerate(requests)]
        call.handles = handles
        with self.transport.hold(), self._lock:
            call.open = len(handles)
            self._calls.append(call)
            for h in handles:
                self.handles[h.rid] = h
                if h.error is not None:
                    self._fail_before_admission(h, h.error)
                else:
                    call.queue.append(h)
            self._admit_more()
            if call.open == 0:
                self._call_ended(call)
        return call

    def _check_open(self, concurrency: int | None) -> None:
        """Raise unless the engine can take a submission (`submit` lists the errors)."""
        if self._closed:
            raise RuntimeError("this Router is closed; create a new one")
        self.check_alive()
        if self._dead:
            m, why = next(iter(self._dead.items()))
            raise EngineDeadError(
                f"the sub-server of model '{m}' is dead ({why}); this Router cannot serve new "
                f"requests until it is restarted: router.restart('{m}'), or close it and build "
                f"a new Router"
            )
        if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
            raise ValueError(f"concurrency must be None or an int >= 1, got {concurrency!r}")

    def _new_handle(
        self, i: int, req: RequestInput, policy: Policy, call: Call, key: int, seen: collections.Counter
    ) -> RequestHandle:
        """The handle of request ``i`` of ``call`` (policy ``key``): its id and request key (``seen``:
        how many of each given token sequence came before it in the call), its entry model and
        the peers it prefills (the policy's ``entry`` and ``may_use``, run by the host: an error
        there fails it before admission), its stop ids and its KV need."""
        ids = list(req.prompt_ids or [])
        rkey = req.key
        if rkey is None:  # from the tokens given: the prompt, and the forced output of a scored request
            given = tuple(ids) + tuple(req.forced or ())
            occ = seen[given]
            seen[given] += 1
            rkey = prompt_key(list(given), occ)
        with self._lock:
            rid = self._next_rid
            self._next_rid += 1
        cfg = RequestConfig(
            rid,
            ids,
            req.params,
            key,
            self.eos_ids,
            rkey,
            tuple(req.forced or ()),
            prompts=req.prompts if self.text is not None else None,
        )
        error, entry, state, peers = req.error, self.models[0], {}, ()
        models = tuple(self.models)
        if error is None:
            entry, error = self.host.entry(
                policy,
                RequestView(
                    rid=rid,
                    prompt_ids=cfg.prompt_ids,
                    output_ids=[],
                    owner="",
                    state=state,
                    hops=0,
                    models=models,
                    key=rkey,
                ),
            )
        if error is None and self.config.prefill_peers:
            peers, error = self.host.may_use(
                policy,
                RequestView(
                    rid=rid,
                    prompt_ids=cfg.prompt_ids,
                    output_ids=[],
                    owner=entry,
                    state=state,
                    hops=0,
                    models=models,
                    key=rkey,
                ),
            )
        p = req.params
        h = RequestHandle(
            cfg, req.prompt, entry, call, i, self.tokenizer, vocabs=self.text.vocabs if self.text is not None else None
        )
        h.output.sample = req.sample
        h.t_submit, h.state, h.error, h.peers = self.clock(), state, error, peers
        h.need, h.shared = self.kv.need(cfg.prompts or ids, p.max_new_tokens)
        return h

    def _fail_before_admission(self, h: RequestHandle, error: str) -> None:
        ev = messages.Admitted(h.rid, h.entry, self.clock())
        self._record(h.call, ev)
        self._end(h, "failed", error, self.clock())

    def _fits(self, h: RequestHandle) -> bool:
        if self._inflight == 0 or self.config.kv_admission == "optimistic":
            return True
        return self.kv.fits(h.need, h.shared)

    def _admit_more(self) -> None:
        admitted = False
        cap = self.config.max_concurrency
        for call in list(self._calls):
            while call.queue and (cap is None or self._inflight < cap):
                if call.limit is not None and call.inflight >= call.limit:
                    break
                h = call.queue[0]
                if h.entry in self._dead:
                    call.queue.popleft()
                    self._fail_before_admission(h, f"model '{h.entry}' is dead: {self._dead[h.entry]}")
                    continue
                if not self._fits(h):
                    if call.limit is None or call.inflight < call.limit:
                        call.kv_limited = max(call.kv_limited, call.inflight)
                    return self._kick() if admitted else None  # first come, first served
                call.queue.popleft()
                self._admit(h)
                admitted = True
        if admitted:
            self._kick()

    def _admit(self, h: RequestHandle) -> None:
        h.t_admit = self.clock()
        self._inflight += 1
        h.call.inflight += 1
        self.kv.reserve(h.need, h.shared)
        self._record(h.call, messages.Admitted(h.rid, h.entry, h.t_admit))
        if self.config.mode.batches_delayed:
            self._broadcast_inflight()
        peers = tuple(m for m in h.peers if m not in self._dead)
        h.visited = {h.entry, *peers}
        for m in peers:  # before the Admit: the entry's first handoff can only come after it
            self.transport.send(m, messages.Prefill(h.config, h.entry))
        self.transport.send(h.entry, messages.Admit(h.config, h.t_admit, h.state, peers))

    # -- thresholds and gated modes ---------------------------------------------------------
    def set_thresholds(self, thresholds: dict[str, int]) -> None:
        """Change the delayed batching thresholds B_i (models not named keep theirs).

        Raises:
            ValueError: a threshold below 1 or an unknown model.
        """
        new = valid_thresholds({**self.thresholds, **thresholds}, self.models)
        with self._lock:
            self.thresholds = new
        for name in self.models:
            self.transport.send(name, messages.SetThresholds(new))

    def check_thresholds(self, n: int) -> None:
        """Raise ValueError unless sum_i (B_i - 1) < n (TokenRouter paper, appendix: with fewer
        requests in flight, every model can wait below its threshold forever)."""
        if not self.config.mode.batches_delayed:
            return
        slack = sum(b - 1 for b in self.thresholds.values())
        if slack >= n:
            raise ValueError(
                f"delayed batching thresholds {self.thresholds} need sum(B_i - 1) = {slack} < N, "
                f"but N = {n} requests are in flight; lower a threshold or raise concurrency "
                f"to at least {slack + 1}"
            )

    def _broadcast_inflight(self) -> None:
        for name in self.models:
            self.transport.send(name, messages.SetInflight(self._inflight))

    def _kick(self) -> None:
        """Gated modes: start the next round if none is running and work is in flight."""
        if not self.config.mode.gated or self._awaiting or self._inflight == 0 or self._closed:
            return
        self._round += 1
        targets = self.config.mode.round_targets([m for m in self.models if m not in self._dead], self._next_target)
        self._next_target += 1
        self._awaiting = set(targets)
        for name in targets:
            self.transport.send(name, messages.Go(self._round))

    def _round_done(self, model: str, rnd: int | None) -> None:
        if rnd is not None and rnd == self._round:
            self._awaiting.discard(model)
            if not self._awaiting:
                self._kick()

    # -- abort ------------------------------------------------------------------------------
    def abort(self, rid: int, reason: str = "aborted by the user") -> None:
        """End request ``rid`` now: its output is final (``finish_reason == "aborted"``, error
        ``reason``) and nothing is committed to it afterwards; the sub-servers stop it at their
        next step boundary, wherever it is (waiting, running, pending on a peer, mid-handoff),
        and free its KV on every model. A request that already ended is left as it is."""
        with self._lock:
            h = self.handles.get(rid)
            if h is None or h.done.is_set():
                return
            admitted = h.t_admit is not None
            if not admitted:
                h.call.queue.remove(h)
                self._record(h.call, messages.Admitted(h.rid, h.entry, self.clock()))
            self._end(h, "aborted", reason, self.clock())
        if admitted:
            self._abort_on_models(rid, "aborted", reason)

    # -- events -----------------------------------------------------------------------------
    def add_observer(self, fn: Callable[[object], None]) -> Callable[[], None]:
        """Call ``fn(event)`` for every event (engine thread, under the engine lock: keep it
        short); returns a function that removes it. For Router-wide counters and exporters."""
        with self._lock:
            self._observers.append(fn)

        def remove():
            with self._lock:
                if fn in self._observers:
                    self._observers.remove(fn)

        return remove

    def _record(self, call: Call | None, ev) -> None:
        self.recent.append(ev)
        if call is not None:
            call.events.append(ev)
        for fn in self._observers:
            fn(ev)

    def handle_event(self, ev) -> None:
        """Apply one event from a sub-server (the transports call this; takes the engine lock).

        Raises:
            UnknownMessage: ``ev`` is not an event the engine knows (names its type).
        """
        with self._lock:
            self._on_event(ev)

    def _on_event(self, ev) -> None:
        """Dispatch by type; the caller holds ``_lock``."""
        dispatch(self._event_handlers, ev, "the engine")

    def _on_step_done(self, ev: messages.StepDone) -> None:
        self.recent.append(ev)
        for call in self._calls:
            if call.inflight:
                call.events.append(ev)
        for fn in self._observers:
            fn(ev)
        self._round_done(ev.model, ev.round)

    def _on_idle(self, ev: messages.Idle) -> None:
        self._round_done(ev.model, ev.round)

    def _on_stats(self, ev: messages.Stats) -> None:
        box = self._stats.get(ev.token)
        if box is not None:
            box[ev.model] = ev
            self._stats_cv.notify_all()

    def _on_died(self, ev: messages.ModelDied) -> None:
        self._model_died(ev.model, ev.error)

    def _live_handle(self, ev) -> RequestHandle | None:
        h = self.handles.get(ev.rid)
        return None if h is None or h.done.is_set() else h

    def _on_committed(self, ev: messages.Committed) -> None:
        h = self._live_handle(ev)
        if h is None:
            return
        if h.t_first is None:
            h.t_first = ev.t
        still_served = not ev.last  # the sub-server has not ended it itself
        ev, piece = h.commit(ev)
        self._record(h.call, ev)
        if h.call.listener is not None:
            h.call.listener("tokens", h, (ev, piece))
        if h.stop_hit is not None:  # a stop string ends it: the sub-servers stop it and free its KV
            self._end(h, "stop", None, ev.t, h.stop_hit)
            if still_served:
                self._abort_on_models(h.rid, "stop", None)

    def _on_hopped(self, ev: messages.Hopped) -> None:
        h = self._live_handle(ev)
        if h is None:
            return
        out = h.output
        self._record(h.call, ev)
        h.owner = ev.dst
        h.visited.add(ev.dst)
        if ev.dst in self._dead:
            self._end(
                h, "failed", f"model '{ev.dst}' is dead ({self._dead[ev.dst]}): the request was routed to it", ev.t
            )
            self._release_live(h.rid)
            return
        out.hops += 1
        out.discarded += 0 if ev.kept else 1
        if not ev.kept and ev.token is not None:
            out.discarded_log.append((len(out.token_ids), ev.token, ev.src))
        if h.call.listener is not None:
            h.call.listener("hop", h, ev)

    def _on_retokenized(self, ev: messages.Retokenized) -> None:
        h = self._live_handle(ev)
        if h is not None:
            self._record(h.call, ev)

    def _on_resampled(self, ev: messages.Resampled) -> None:
        h = self._live_handle(ev)
        if h is None:
            return
        self._record(h.call, ev)
        h.output.discarded += 1
        h.output.discarded_log.append((len(h.output.token_ids), ev.token, ev.model))

    def _on_finished(self, ev: messages.Finished) -> None:
        h = self._live_handle(ev)
        if h is None:
            return
        self._end(h, ev.reason, ev.error, ev.t, ev.stop_reason, ev.traceback)
        if ev.model in self._dead or ev.undelivered:  # answered for a dead model: free what the live ones hold
            self._release_live(h.rid)

    def _end(
        self, h: RequestHandle, reason: str, error: str | None, t: float, stop_reason=None, tb: str | None = None
    ) -> None:
        """Make ``h``'s output final (first end wins) and free its place."""
        out = h.output
        out.finish_reason, out.error, out.stop_reason, out.traceback = reason, error, stop_reason, tb
        out.text = h.finalize_text()
        h.t_end = t
        t0 = h.t_admit if h.t_admit is not None else h.t_submit
        out.latency_s = t - t0
        out.ttft_s = None if h.t_first is None else h.t_first - t0
        self._record(h.call, messages.Finished(h.rid, h.owner, reason, error, t, stop_reason, tb))
        call = h.call
        if h.t_admit is not None:
            self._inflight -= 1
            call.inflight -= 1
            self.kv.release(h.need, h.shared)
            if self.config.mode.batches_delayed:
                self._broadcast_inflight()
        self.handles.pop(h.rid, None)
        piece = h.take_text(len(out.text))
        h.done.set()
        if call.listener is not None:
            call.listener("finish", h, piece)
        call.open -= 1
        if call.open == 0:
            self._call_ended(call)
        self._admit_more()

    def _call_ended(self, call: Call) -> None:
        if call in self._calls:
            self._calls.remove(call)
        self._unregister(call.policy_key)
        call.done.set()
        for fn in self._done_waiters.pop(id(call), []):
            fn()

    def events_of(self, call: Call) -> list:
        """A copy of ``call``'s events so far, taken under the engine's lock."""
        with self._lock:
            return list(call.events)

    def on_done(self, call: Call, fn: Callable[[], None]) -> None:
        """Run ``fn`` (from the engine's thread) when ``call`` ends, or now if it has."""
        with self._lock:
            if not call.done.is_set():
                self._done_waiters.setdefault(id(call), []).append(fn)
                return
        fn()

    # -- dead sub-servers -------------------------------------------------------------------
    def check_alive(self) -> None:
        """Report sub-servers that stopped without saying so (a fallback of the transports'
        own death reports)."""
        if self._closed:
            return
        for m in self.models:
            if m not in self._dead and not self.transport.alive(m):
                self.handle_event(messages.ModelDied(m, f"sub-server '{m}' is not running", self.clock()))

    def _model_died(self, model: str, error: str) -> None:
        """Fail every request ``model`` held (it owned it, or kept its KV pending: a return there
        would find none, also on a restarted sub-server), free what the live models hold of
        them, fail the queued requests that enter on it; observers see the `ModelDied`."""
        if model in self._dead or self._closed:
            return
        self._dead[model] = error
        for h in list(self.handles.values()):
            if h.t_admit is not None and model in h.visited and not h.done.is_set():
                self._end(h, "failed", f"model '{model}' died while it held this request: {error}", self.clock())
                self._release_live(h.rid)
        for call in list(self._calls):
            for h in [h for h in call.queue if h.entry == model]:
                call.queue.remove(h)
                self._fail_before_admission(h, f"model '{model}' is dead: {error}")
        self._awaiting.discard(model)
        if not self._awaiting:
            self._kick()
        ev = messages.ModelDied(model, error, self.clock())
        for fn in self._observers:
            fn(ev)

    def restart(self, model: str, timeout: float | None = None) -> None:
        """Start the sub-server of dead model ``model`` again, from the spec it started with: a
        fresh KV pool, the policies of the calls still running and the current thresholds; the
        engine then serves new requests again. The requests the dead sub-server held were failed
        when it died (`EngineDeadError` is no longer raised once every model lives).

        Args:
            timeout: seconds to wait for a sub-server elsewhere to connect (None: the
                transport's start timeout).

        Raises:
            RuntimeError: the engine is closed; ``model`` is running; the transport cannot
                restart a sub-server (names it); the new sub-server failed to start or reported
                its runner built otherwise than planned (the model stays dead).
            ValueError: no model of that name.
            Exception: what building its runner raised (sub-servers in threads).
        """
        if self._closed:
            raise RuntimeError("restart: this Router is closed; create a new one")
        if model not in self.models:
            raise ValueError(f"restart: no model {model!r}; the models are {self.models}")
        self.check_alive()
        if model not in self._dead:
            raise RuntimeError(f"restart('{model}'): its sub-server is running; only a dead one is restarted")
        with self._lock:
            first = [messages.RegisterPolicy(k, pol) for k, (pol, _) in self._policies.items()]
            first.append(messages.SetThresholds(dict(self.thresholds)))
            if self.config.mode.batches_delayed:
                first.append(messages.SetInflight(self._inflight))
        self.transport.restart(model, first, timeout)
        got = self.transport.reported().get(model)
        want = self.info[model].geometry()
        if got is not None and got != want:
            self.transport.send(model, messages.Shutdown())
            raise RuntimeError(
                f"restart('{model}'): its runner was built as {got} in its new sub-server, but its "
                f"spec described {want}"
            )
        with self._lock:
            self._dead.pop(model, None)
            self._kick()

    def _release_live(self, rid: int) -> None:
        """A request ended without its owner's word (its owner died): the live models that hold
        KV of it pending free it."""
        self._abort_on_models(rid, "failed", None)

    def _abort_on_models(self, rid: int, status: str, reason: str | None) -> None:
        """Tell every live sub-server to stop request ``rid`` and free its KV (a dead one holds
        none: its pool went with it)."""
        for m in self.models:
            if m not in self._dead:
                self.transport.send(m, messages.Abort(rid, status, reason))

    @property
    def dead(self) -> dict[str, str]:
        """Dead models and why."""
        return dict(self._dead)

    # -- state ------------------------------------------------------------------------------
    def consistent(self):
        """Context manager: while inside, no event is applied (the engine lock), so several reads
        of calls, handles and outputs agree with each other. Keep it short: the engine waits."""
        return self._lock

    def recent_events(self) -> list:
        """A snapshot of the last `RECENT_EVENTS` events engine-wide (oldest first)."""
        with self._lock:
            return list(self.recent)

    def requests(self) -> list[RequestHandle]:
        """A snapshot of the requests not ended yet (queued or in flight)."""
        with self._lock:
            return list(self.handles.values())

    def request_counts(self) -> dict[str, int]:
        """``{"in_flight": admitted and not ended, "waiting": submitted and not admitted}``."""
        with self._lock:
            admitted = sum(1 for h in self.handles.values() if h.t_admit is not None)
            return {"in_flight": admitted, "waiting": len(self.handles) - admitted}

    def active_calls(self) -> list[Call]:
        with self._lock:
            return list(self._calls)

    def idle(self) -> bool:
        """True when no request is queued or in flight and every live sub-server holds no request
        (owned or pending), asked through the transport (`kv_stats`), so the answer comes after
        the messages sent to it before; a closed engine is idle once its handles are ended."""
        with self._lock:
            if self.handles:
                return False
        if self._closed:
            return True
        return all(not s.alive or (s.owned == 0 and s.pending == 0) for s in self.kv_stats().values())

    def wait_idle(self, timeout: float = 10.0) -> bool:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.idle():
                return True
            time.sleep(0.01)
        return self.idle()

    def clear_prefix_cache(self) -> None:
        """Every live sub-server forgets its prefix cache (`ClearPrefixCache`) before it handles
        anything sent after this call (messages to a model are handled in order).

        Raises:
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("clear_prefix_cache: the Router is closed")
        for name in self.models:
            if name not in self._dead:
                self.transport.send(name, messages.ClearPrefixCache())

    def kv_stats(self, timeout: float = 10.0) -> dict[str, messages.Stats]:
        """Each sub-server's KV pool and request counts (`Stats`), asked through the transport,
        so sub-servers in processes answer too; a dead model answers at once (``alive=False``).
        A sub-server answers after the messages sent to it before.

        Raises:
            TimeoutError: a live sub-server did not answer within ``timeout`` seconds (names it).
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("kv_stats: the Router is closed (its sub-servers and KV pools are gone)")
        self.check_alive()
        dead = {
            m: messages.Stats(m, 0, 0, self.capacity[m][0], self.capacity[m][1], 0, 0, alive=False, error=why)
            for m, why in self._dead.items()
        }
        live = [m for m in self.models if m not in dead]
        with self._lock:
            self._next_token += 1
            token, box = self._next_token, {}
            self._stats[token] = box
        try:
            for name in live:
                self.transport.send(name, messages.StatsQuery(token))
            deadline = time.perf_counter() + timeout
            with self._stats_cv:
                while any(m not in box and m not in self._dead for m in live):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        missing = [m for m in live if m not in box]
                        raise TimeoutError(f"sub-server(s) {missing} did not report KV stats within {timeout} s")
                    self._stats_cv.wait(min(left, 0.25))
                    self.check_alive()
            return {
                m: box.get(m)
                or messages.Stats(
                    m, 0, 0, self.capacity[m][0], self.capacity[m][1], 0, 0, alive=False, error=self._dead.get(m)
                )
                for m in self.models
            }
        finally:
            with self._lock:
                self._stats.pop(token, None)

    def close(self) -> None:
        """Stop the sub-servers; unfinished requests end ``aborted``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.transport.close()
        with self._lock:
            for h in list(self.handles.values()):
                if not h.done.is_set():
                    self._end(h, "aborted", "the Router was closed", self.clock())
        self._observers.clear()
