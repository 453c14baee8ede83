"""The naive reference: recompute the whole prefix on every step, no KV cache, no batching,
one request at a time, applying the same policy. It defines what the engine must produce: with
greedy decoding, the engine's tokens equal these."""

from __future__ import annotations

import torch

from .engine.sampler import make_generator, sample
from .policy import Handoff, Policy, StepBatch
from .request import RequestView, SamplingParams, prompt_key


@torch.inference_mode()
def _last(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    dev = next(model.parameters()).device
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    h = dec(input_ids=torch.tensor([ids], device=dev), use_cache=False).last_hidden_state[0, -1]
    return model.get_output_embeddings()(h), h


def reference_generate(models: dict, prompt_ids: list[int], policy: Policy, params: SamplingParams,
                       *, eos_ids: tuple[int, ...] = (), rid: int = 0, tokenizer=None, key=None,
                       vocab_limit: int | None = None) -> dict:
    """Generate one request the slow, obviously-correct way.

    Args:
        models: name -> model, smallest first (as given to the Router).
        prompt_ids: shape [P].
        policy: the policy (its per-request state starts empty).
        params: sampling parameters (greedy for exact equivalence; seeded sampling draws
            from the same per-(seed, model) generators as the engine).
        eos_ids: end-of-sequence ids.
        rid: request id the policy sees.
        tokenizer: what ``step.tokenizer`` gives the policy.
        key: the request key the policy sees (default: the engine's default key of a prompt
            that is the first of its kind in its call, `prompt_key`).
        vocab_limit: logits beyond it are cut before sampling (default: the smallest vocabulary
            of the models and the tokenizer, as the engine does).

    Returns:
        dict with ``token_ids``, ``token_models``, ``hops``, ``discarded``, ``finish_reason``,
        ``logits`` (the last-position logits of every step, for tolerance checks).
    """
    names = list(models)
    key = prompt_key(prompt_ids) if key is None else key
    limit = vocab_limit or min([m.get_output_embeddings().weight.shape[0] for m in models.values()]
                               + ([len(tokenizer)] if tokenizer is not None else []))
    max_ctx = min(int(getattr(m.config, "max_position_embeddings", 1 << 30)) for m in models.values())
    gens = {n: make_generator(params.seed, i, next(models[n].parameters()).device) for i, n in enumerate(names)}
    state: dict = {}
    out: list[int] = []
    who: list[str] = []
    hops = discarded = 0
    span, return_to = None, None
    all_logits = []
    owner = policy.entry(RequestView(rid, list(prompt_ids), [], "", state, 0, tuple(names), key), names) or names[0]

    def view():
        return RequestView(rid, list(prompt_ids), list(out), owner, state, hops, tuple(names), key)

    def commit(tok) -> str | None:
        out.append(tok)
        who.append(owner)
        if tok in params.stop_token_ids:
            return "stop"
        if tok in eos_ids and not params.ignore_eos:
            return "eos"
        if len(out) >= params.max_new_tokens or len(prompt_ids) + len(out) >= max_ctx:
            return "length"
        return None

    while True:
        logits, hidden = _last(models[owner], list(prompt_ids) + out)
        logits = logits[:limit]
        all_logits.append(logits)
        tok = int(sample(logits[None], [params], [gens[owner]])[0])
        if span is not None:
            span -= 1
            reason = commit(tok)
            if reason:
                break
            if span == 0:
                owner, span, return_to = return_to, None, None
                hops += 1
            continue
        sb = StepBatch(owner, names, torch.tensor([tok]), logits[None], hidden[None], [view()], tokenizer,
                       needs=policy.needs, policy=repr(policy))
        dec = policy.route_batch(sb)[0]
        if isinstance(dec, bool) and len(names) == 2:
            dec = names[1 - names.index(owner)] if dec else owner
        if dec not in names:
            raise ValueError(f"policy returned unknown model {dec!r}")
        if dec == owner:
            reason = commit(tok)
            if reason:
                break
            continue
        h = policy.send(view(), dec) or Handoff()
        if h.keep_sampled:
            reason = commit(tok)
            if reason:
                break
        else:
            discarded += 1
        if h.span is not None:
            span, return_to = h.span, owner
        owner = dec
        hops += 1
        policy.receive(h, view())
    return {"token_ids": out, "token_models": who, "hops": hops, "discarded": discarded,
            "finish_reason": reason, "logits": all_logits}
