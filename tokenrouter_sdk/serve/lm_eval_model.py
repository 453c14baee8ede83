"""The ``tokenrouter`` model type of lm-evaluation-harness: a `Router` driven in-process.

    python -m tokenrouter_sdk.serve.lm_eval_cli --model tokenrouter \\
        --model_args policy=rstitch,tau=0.1,max_gen_toks=256 --tasks gsm8k --limit 32

Importing this module registers the type (lm-eval has no plugin entry point for model types,
so a plain ``lm_eval`` command does not find it: use the wrapper above, or import this module
before ``lm_eval.simple_evaluate(model="tokenrouter", ...)``). Only generation tasks
(``output_type: generate_until``) run: the engine does not return token log-probabilities.
The results' ``config.tokenrouter`` holds the routing of the whole evaluation: hop rate, large
fraction, committed tokens and committed tokens/s.

Model arguments (``--model_args k=v,...``):
    policy: a built-in policy name (default ``rstitch``); every other unknown key is one of
        its arguments (``tau=0.1``, ``p=0.3``, ``head=PATH``, ...).
    small_model, large_model: model folders / GGUF files / hub ids (default: the packaged
        pair); small_layers: the packaged pair's small model as its first K layers.
    mode, thresholds, max_kv_tokens, max_concurrency, processes: engine settings.
    concurrency: requests in flight (default 32); max_gen_toks: default generation length
        (default 256); chat: apply the chat template to each context (default False:
        lm-eval's ``--apply_chat_template`` renders it instead).
    router: a ready `Router` (Python use only; then the model arguments above are not used).
"""

from __future__ import annotations

import logging
import time

import lm_eval.models  # noqa: F401 - fills lm-eval's registry first (it imports it only while empty)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..policies.registry import builtin_registry

log = logging.getLogger("tokenrouter.lm_eval")

ENGINE_KEYS = ("mode", "thresholds", "max_kv_tokens", "max_concurrency", "processes", "block_size")


@register_model("tokenrouter")
class TokenRouterLM(LM):
    """lm-eval's view of a `Router` (see the module docstring for the arguments).

    Raises:
        PolicySpecError: an unknown policy or policy argument (names it).
    """

    def __init__(self, policy: str = "rstitch", small_model: str | None = None, large_model: str | None = None,
                 small_layers: int | None = None, concurrency: int = 32, max_gen_toks: int = 256, chat: bool = False,
                 router=None, batch_size=None, max_batch_size=None, device=None, **kwargs):
        super().__init__()
        engine = {k: kwargs.pop(k) for k in list(kwargs) if k in ENGINE_KEYS}
        registry = builtin_registry()
        self.policy_spec = {"name": policy, **kwargs}
        self.policy = registry.build(self.policy_spec)
        if router is not None:
            self.router, self._own = router, False
        else:
            from ..router import Router
            if (small_model is None) != (large_model is None):
                raise ValueError("give both small_model and large_model, or neither (the packaged pair)")
            if small_model is None:
                self.router = Router.default(self.policy, small_layers=small_layers, **engine)
            else:
                self.router = Router({"small": small_model, "large": large_model}, self.policy, **engine)
            self._own = True
        self.concurrency, self.max_gen_toks, self.chat = int(concurrency), int(max_gen_toks), bool(chat)
        self.totals = {"committed_tokens": 0, "hops": 0, "large_tokens": 0, "generate_s": 0.0, "requests": 0,
                       "failed": 0}

    # -- lm-eval's interface ------------------------------------------------------------------------
    def loglikelihood(self, requests):
        raise NotImplementedError("the tokenrouter model type runs generation tasks only (output_type: "
                                  "generate_until): the engine does not return token log-probabilities")

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError("the tokenrouter model type runs generation tasks only (output_type: "
                                  "generate_until): the engine does not return token log-probabilities")

    def _sampling(self, gen_kwargs: dict) -> dict:
        kw = dict(gen_kwargs)
        until = kw.pop("until", None)
        stop = [until] if isinstance(until, str) else [s for s in (until or []) if s]
        do_sample = kw.pop("do_sample", None)
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        if do_sample is False:
            temperature = 0.0
        out = {"max_new_tokens": int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks))),
               "temperature": temperature, "stop": tuple(stop)}
        for key in ("top_p", "top_k", "seed"):
            if kw.get(key) is not None:
                out[key] = kw.pop(key)
        if kw:
            log.warning("tokenrouter: ignoring generation arguments %s", sorted(kw))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate each request's continuation, stopped at its ``until`` strings; requests with
        the same generation arguments run as one call at ``concurrency``."""
        groups: dict[tuple, list[int]] = {}
        sampling = []
        for i, req in enumerate(requests):
            s = self._sampling(req.args[1])
            sampling.append(s)
            groups.setdefault(tuple(sorted((k, str(v)) for k, v in s.items())), []).append(i)
        texts: list[str] = [""] * len(requests)
        for idx in groups.values():
            prompts = [requests[i].args[0] for i in idx]
            t0 = time.perf_counter()
            outs = self.router.generate(prompts, chat=self.chat, concurrency=self.concurrency,
                                        progress=not disable_tqdm, **sampling[idx[0]])
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
        ``large_fraction``, ``committed_tokens``, ``committed_tok_s`` (over the time spent in
        generation calls), ``requests``, ``failed`` and the policy."""
        t = self.totals
        n = t["committed_tokens"]
        return {"policy": repr(self.policy), "models": list(self.router.models), "requests": t["requests"],
                "failed": t["failed"], "committed_tokens": n, "hops": t["hops"],
                "hop_rate": t["hops"] / n if n else 0.0, "large_fraction": t["large_tokens"] / n if n else 0.0,
                "generate_s": t["generate_s"], "committed_tok_s": n / t["generate_s"] if t["generate_s"] else 0.0}

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

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.router.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)

    def close(self) -> None:
        """Close the Router if this object built it."""
        if self._own:
            self.router.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
