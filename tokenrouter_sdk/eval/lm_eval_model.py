"""The ``tokenrouter`` model type of lm-evaluation-harness: a `Router` driven in-process.

    python -m tokenrouter_sdk.cli.lm_eval --model tokenrouter --batch_size 32 \\
        --model_args policy=rstitch,tau=0.3,tau_back=0.02,max_gen_toks=256 --tasks gsm8k --limit 32

Importing this module registers the type (lm-eval has no plugin entry point for model types,
so a plain ``lm_eval`` command does not find it: use the wrapper above, or import this module
before ``lm_eval.simple_evaluate(model="tokenrouter", ...)``). Generation tasks
(``generate_until``), log-likelihood tasks (``loglikelihood``: multiple choice such as ARC,
HellaSwag, MMLU, CommonsenseQA) and perplexity tasks (``loglikelihood_rolling``) run.

A routed log-likelihood (`Router.score`): the context is the prompt, prefilled by the policy's
entry model as in generation; the continuation is teacher-forced through the policy: at each
position the policy routes exactly as it would while generating (it sees the given token as the
step's token), and the model that writes the position scores the given token (its
log-probability). The sum is the log-likelihood of the continuation under routed decoding;
``is_greedy`` says whether every given token was its writer's most likely one. With
``route_context=True`` the context is teacher-forced too, from its first token on, which is what
a server computes for ``echo`` + ``logprobs`` (lm-eval's ``local-completions``), so both give the
same numbers.

The results' ``config.tokenrouter`` holds the routing of the whole evaluation: hop rate, large
fraction, committed tokens (generated and scored) and committed tokens/s.

Model arguments (``--model_args k=v,...``); every one takes effect or raises:
    policy: a registry spec name (default ``rstitch``; with ``router``: that Router's policy);
        every other unknown key is one of its arguments (``tau=0.3``, ``p=0.3``, ``head=PATH``).
    small_model, large_model: model folders / GGUF files / hub ids (default: the packaged
        pair); small_layers: the packaged pair's small model as its first K layers.
    device, dtype: placement and precision of every model (``cuda:0``, ``bfloat16``; default
        ``cpu`` and ``auto``, the packaged pair float32); small_device, large_device,
        small_dtype, large_dtype: per model (with small_model/large_model).
    mode, thresholds, max_kv_tokens, kv_memory_fraction, max_concurrency, processes,
        block_size, prefill_peers, cuda_graphs: engine settings.
    concurrency: requests in flight; default: lm-eval's ``batch_size`` (an int; ``auto``: all
        requests at once, bounded by the KV pools, at most ``max_batch_size``), else 32.
    add_bos_token: encode lm-eval's text contexts with the tokenizer's special tokens (its
        BOS); default as lm-eval's ``hf`` and ``vllm`` models: True for Gemma tokenizers (which
        need their BOS), else False.
    max_gen_toks: default generation length (256); chat: apply the chat template to each
        context of generation tasks (default False: lm-eval's ``--apply_chat_template``
        renders it instead); chat_template_kwargs (a dict, or JSON text) and enable_thinking:
        variables of the chat template; route_context: see above.
    router: a ready `Router` (Python use only; then the model and engine arguments above must
        not be given).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time

import lm_eval.models  # noqa: F401 - fills lm-eval's registry first (it imports it only while empty)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from ..policies.registry import builtin_registry

log = logging.getLogger("tokenrouter.lm_eval")

ENGINE_KEYS = (
    "mode",
    "thresholds",
    "max_kv_tokens",
    "kv_memory_fraction",
    "max_concurrency",
    "processes",
    "block_size",
    "prefill_peers",
    "cuda_graphs",
)
MODEL_KEYS = (
    "small_model",
    "large_model",
    "small_layers",
    "device",
    "dtype",
    "small_device",
    "large_device",
    "small_dtype",
    "large_dtype",
)
DEFAULT_CONCURRENCY = 32
_COLLECTING: contextvars.ContextVar[list | None] = contextvars.ContextVar("tokenrouter_lm_eval_models", default=None)


@contextlib.contextmanager
def collect_models():
    """Within the block, every `TokenRouterLM` built is appended to the yielded list (what the
    command-line wrapper reads the routing of after lm-eval's table); outside it none is kept."""
    made: list = []
    token = _COLLECTING.set(made)
    try:
        yield made
    finally:
        _COLLECTING.reset(token)


def _concurrency(concurrency, batch_size, max_batch_size) -> int | None:
    """Requests in flight from the model arguments: ``concurrency`` wins, else lm-eval's
    ``batch_size`` (``auto``: None, all at once, or ``max_batch_size``), else 32.

    Raises:
        ValueError: ``max_batch_size`` without ``batch_size=auto`` (it caps only that), or a
            batch size that is neither an int nor ``auto``.
    """
    auto = isinstance(batch_size, str) and batch_size.strip().lower().startswith("auto")
    if max_batch_size is not None and not auto:
        raise ValueError(
            "max_batch_size caps batch_size=auto only; with another batch_size it has no effect: drop "
            "it or pass --batch_size auto"
        )
    if concurrency is not None:
        return int(concurrency)
    if batch_size is None:
        return DEFAULT_CONCURRENCY
    if auto:
        return None if max_batch_size is None else int(max_batch_size)
    try:
        return int(batch_size)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size must be an int or 'auto', got {batch_size!r}") from None


def _flag(value) -> bool:
    """A model argument as a bool (``--model_args`` values may arrive as text)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _is_gemma(tokenizer) -> bool:
    """Whether ``tokenizer`` is a Gemma one (its class or its source names Gemma): lm-eval's
    ``hf`` and ``vllm`` models add the BOS to every context for Gemma, which degrades without it."""
    names = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "") or ""))
    return any("gemma" in n.lower() for n in names)


@register_model("tokenrouter")
class TokenRouterLM(TemplateLM):
    """lm-eval's view of a `Router` (see the module docstring for the arguments).

    Raises:
        PolicySpecError: an unknown policy or policy argument (names it).
        ValueError: arguments that cannot take effect together (``router`` with model or engine
            arguments, one of small_model/large_model, per-model devices with the packaged pair).
    """

    def __init__(
        self,
        policy: str | None = None,
        small_model: str | None = None,
        large_model: str | None = None,
        small_layers: int | None = None,
        concurrency: int | None = None,
        max_gen_toks: int = 256,
        chat: bool = False,
        router=None,
        batch_size=None,
        max_batch_size=None,
        device=None,
        dtype=None,
        small_device=None,
        large_device=None,
        small_dtype=None,
        large_dtype=None,
        chat_template_kwargs=None,
        enable_thinking: bool | None = None,
        route_context: bool = False,
        add_bos_token: bool | None = None,
        **kwargs,
    ):
        super().__init__()
        engine = {k: kwargs.pop(k) for k in list(kwargs) if k in ENGINE_KEYS}
        models = {
            k: v
            for k, v in dict(
                small_model=small_model,
                large_model=large_model,
                small_layers=small_layers,
                device=device,
                dtype=dtype,
                small_device=small_device,
                large_device=large_device,
                small_dtype=small_dtype,
                large_dtype=large_dtype,
            ).items()
            if v is not None
        }
        self.concurrency = _concurrency(concurrency, batch_size, max_batch_size)
        if isinstance(chat_template_kwargs, str):
            chat_template_kwargs = json.loads(chat_template_kwargs)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            self.chat_template_kwargs["enable_thinking"] = bool(enable_thinking)
        if router is not None:
            given = sorted(set(models) | set(engine))
            if given:
                raise ValueError(
                    f"router= is a ready Router: the model and engine arguments {given} cannot apply to "
                    f"it; set them when building the Router"
                )
            if policy is None and kwargs:
                raise ValueError(f"policy arguments {sorted(kwargs)} need a policy name (policy=...)")
            self.router, self._own = router, False
            self.policy = router.policy if policy is None else builtin_registry().build({"name": policy, **kwargs})
            self.policy_spec = None if policy is None else {"name": policy, **kwargs}
        else:
            self.policy_spec = {"name": policy or "rstitch", **kwargs}
            self.policy = builtin_registry().build(self.policy_spec)
            self.router, self._own = self._build(models, engine), True
        self.max_gen_toks, self.chat, self.route_context = int(max_gen_toks), bool(chat), bool(route_context)
        self.add_bos_token = _is_gemma(self.router.tokenizer) if add_bos_token is None else _flag(add_bos_token)
        self.totals = {
            "committed_tokens": 0,
            "hops": 0,
            "large_tokens": 0,
            "generate_s": 0.0,
            "requests": 0,
            "failed": 0,
        }
        made = _COLLECTING.get()
        if made is not None:
            made.append(self)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's constructor from ``--model_args``, with lm-eval's own settings
        (``batch_size``, ``max_batch_size``, ``device``) in ``additional_config``: a ``device``
        in the model arguments wins over ``--device``."""
        from lm_eval import utils

        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """As `create_from_arg_string`, from a dict of model arguments."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    def _build(self, models: dict, engine: dict):
        from ..placement import ModelSpec
        from ..router import Router

        small, large = models.get("small_model"), models.get("large_model")
        if (small is None) != (large is None):
            raise ValueError("give both small_model and large_model, or neither (the packaged pair)")
        per_model = [k for k in ("small_device", "large_device", "small_dtype", "large_dtype") if k in models]
        if small is None:
            if per_model:
                raise ValueError(
                    f"{per_model} need small_model and large_model; the packaged pair shares layers, "
                    f"so it takes one device and dtype"
                )
            return Router.default(
                self.policy,
                small_layers=models.get("small_layers"),
                device=models.get("device"),
                dtype=models.get("dtype"),
                **engine,
            )
        if "small_layers" in models:
            raise ValueError(
                "small_layers shapes the packaged pair's small model; it does not apply with small_model/large_model"
            )
        specs = {
            "small": ModelSpec(small, models.get("small_device"), models.get("small_dtype")),
            "large": ModelSpec(large, models.get("large_device"), models.get("large_dtype")),
        }
        return Router(specs, self.policy, device=models.get("device"), dtype=models.get("dtype"), **engine)

    # -- tokens -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.router.tokenizer.eos_token_id
        return int(eos[0] if isinstance(eos, (list, tuple)) else eos)

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.router.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return int(self.router.max_context)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of a text; ``add_special_tokens`` None: ``add_bos_token`` (lm-eval's rule)."""
        add = self.add_bos_token if add_special_tokens is None else bool(add_special_tokens)
        return list(self.router.tokenizer.encode(string, add_special_tokens=add))

    # -- log-likelihoods ----------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list:
        """Routed scores of ``(context ids, continuation ids)`` pairs: the `RequestOutput` of each,
        whose last ``len(continuation)`` logprobs belong to the continuation.

        Raises:
            RuntimeError: a scoring request failed (its error).
        """
        prompts, conts = [], []
        for ctx, cont in pairs:
            seq = (list(ctx) + list(cont))[-self.max_length :]
            ctx, cont = seq[: max(1, len(seq) - len(cont))], seq[max(1, len(seq) - len(cont)) :]
            if self.route_context:
                ctx, cont = ctx[:1], ctx[1:] + cont
            prompts.append(ctx)
            conts.append(cont)
        t0 = time.perf_counter()
        outs = self.router.score(
            prompts, conts, policy=self.policy, logprobs=1, concurrency=self.concurrency, progress=not disable_tqdm
        )
        self._account(outs, time.perf_counter() - t0)
        bad = next((o for o in outs if not o.ok), None)
        if bad is not None:
            raise RuntimeError(f"tokenrouter: scoring request {bad.index} failed: {bad.error}")
        return outs

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum of the continuation's routed log-probabilities, whether each token was its
        writer's most likely)`` per ``((context, continuation), context ids, continuation ids)``."""
        if self.chat:
            raise ValueError(
                "chat=True renders generation contexts with the chat template; for log-likelihood "
                "tasks use lm-eval's --apply_chat_template instead"
            )
        self._check_template_use()
        outs = self._score([(ctx, cont) for _, ctx, cont in requests], disable_tqdm)
        res = []
        for (key, _, cont), out in zip(requests, outs):
            n = min(len(cont), len(out.logprobs))
            lps, toks, tops = out.logprobs[-n:], out.token_ids[-n:], out.top_logprobs[-n:]
            greedy = all(next(iter(top)) == t for t, top in zip(toks, tops))
            res.append((float(sum(lps)), bool(greedy)))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res[-1])
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The routed log-likelihood of each whole text, in disjoint windows of the models'
        context (lm-eval's rolling windows; the first token is scored after the prefix token)."""
        from lm_eval import utils

        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((ctx, cont))
                owner.append(i)
        outs = self._score(windows, disable_tqdm) if windows else []
        totals = [0.0] * len(requests)
        for i, (_, cont), out in zip(owner, windows, outs):
            totals[i] += float(sum(out.logprobs[-len(cont) :]))
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ---------------------------------------------------------------------------------
    def _sampling(self, gen_kwargs: dict) -> dict:
        """Router sampling keywords from a task's ``generation_kwargs``.

        Raises:
            ValueError: a generation argument the Router does not take (names it).
        """
        kw = dict(gen_kwargs)
        until = kw.pop("until", None)
        stop = [until] if isinstance(until, str) else [s for s in (until or []) if s]
        do_sample = kw.pop("do_sample", None)
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        if do_sample is False:
            temperature = 0.0
        out = {
            "max_new_tokens": int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks))),
            "temperature": temperature,
            "stop": tuple(stop),
        }
        for key in ("top_p", "top_k", "seed"):
            if kw.get(key) is not None:
                out[key] = kw.pop(key)
        if kw:
            raise ValueError(
                f"tokenrouter: generation arguments {sorted(kw)} are not supported (supported: until, "
                f"do_sample, temperature, max_gen_toks, top_p, top_k, seed)"
            )
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate each request's continuation, stopped at its ``until`` strings; requests with
        the same generation arguments run as one call at ``concurrency``."""
        self._check_template_use()
        groups: dict[tuple, list[int]] = {}
        sampling = []
        for i, req in enumerate(requests):
            s = self._sampling(req.args[1])
            sampling.append(s)
            groups.setdefault(tuple(sorted((k, str(v)) for k, v in s.items())), []).append(i)
        texts: list[str] = [""] * len(requests)
        extra = {"chat_template_kwargs": self.chat_template_kwargs} if self.chat and self.chat_template_kwargs else {}
        for idx in groups.values():
            prompts = [requests[i].args[0] for i in idx]
            t0 = time.perf_counter()
            outs = self.router.generate(
                prompts,
                policy=self.policy,
                chat=self.chat,
                concurrency=self.concurrency,
                progress=not disable_tqdm,
                add_special_tokens=self.add_bos_token,
                **extra,
                **sampling[idx[0]],
            )
            self._account(outs, time.perf_counter() - t0)
            for i, out in zip(idx, outs):
                texts[i] = out.text if out.ok else ""
                self.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
        log.info("tokenrouter: %s", self.routing())
        return texts

    def _account(self, outs, seconds: float) -> None:
        large = self.router.models and list(self.router.models)[-1]
        t = self.totals
        for o in outs:
            t["committed_tokens"] += len(o.token_ids)
            t["hops"] += o.hops
            t["large_tokens"] += o.token_models.count(large)
            t["failed"] += not o.ok
        t["requests"] += len(outs)
        t["generate_s"] += seconds

    def routing(self) -> dict:
        """The routing over every request so far: ``hop_rate`` (hops per committed token),
        ``large_fraction``, ``committed_tokens`` (generated and scored), ``committed_tok_s`` (over
        the time spent in generation and scoring calls), ``requests``, ``failed`` and the policy."""
        t = self.totals
        n = t["committed_tokens"]
        return {
            "policy": repr(self.policy),
            "models": list(self.router.models),
            "requests": t["requests"],
            "failed": t["failed"],
            "committed_tokens": n,
            "hops": t["hops"],
            "hop_rate": t["hops"] / n if n else 0.0,
            "large_fraction": t["large_tokens"] / n if n else 0.0,
            "generate_s": t["generate_s"],
            "committed_tok_s": n / t["generate_s"] if t["generate_s"] else 0.0,
        }

    def routing_table(self) -> str:
        """`routing` as a Markdown table, the shape of lm-eval's results table: what the
        command-line wrapper prints after it."""
        r = self.routing()
        head = ["policy", "requests", "failed", "committed tokens", "hop rate", "large share", "committed tok/s"]
        row = [
            r["policy"],
            r["requests"],
            r["failed"],
            r["committed_tokens"],
            f"{r['hop_rate']:.4f}",
            f"{r['large_fraction']:.3f}",
            f"{r['committed_tok_s']:.1f}",
        ]
        cells = [[str(c).replace("|", "/") for c in x] for x in (head, row)]
        return "\n".join(["|" + "|".join(c) + "|" for c in (cells[0], ["---"] * len(head), cells[1])])

    def get_model_info(self) -> dict:
        """Added to the results' ``config`` by lm-eval after the evaluation."""
        return {"tokenrouter": self.routing()}

    # -- chat templates (lm-eval's --apply_chat_template) ---------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return getattr(self.router.tokenizer, "name_or_path", "") or type(self.router.tokenizer).__name__

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        template = getattr(self.router.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else ""

    def _check_template_use(self) -> None:
        """Raise ValueError when chat template variables were given but no chat template renders
        the requests (neither ``chat=True`` nor lm-eval's ``--apply_chat_template``)."""
        if self.chat_template_kwargs and not self.chat and not self._templated:
            raise ValueError(
                f"chat_template_kwargs {self.chat_template_kwargs} apply to the chat template, which "
                f"renders no request here: pass --apply_chat_template (or chat=True for generation)"
            )

    _templated = False  # lm-eval rendered a request with apply_chat_template

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        self._templated = True
        return self.router.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
        )

    def close(self) -> None:
        """Close the Router if this object built it."""
        if getattr(self, "_own", False):
            self.router.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
