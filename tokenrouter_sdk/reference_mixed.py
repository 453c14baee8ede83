"""The naive reference for models that do not share a tokenizer: what the engine must produce
for them, computed the slow, obviously-correct way.

The committed output is one byte string. Each model reads its own prompt ids (the prompt
rendered by its own chat template) followed by its own tokens of the output. At every handoff
the receiving model's tokens are the encoding of the *whole* committed output
(`tokenrouter_sdk.byte_vocab.ByteVocab.encode`), and every step recomputes the whole prefix
(no KV cache, no batching, one request at a time). While a model owns the request it appends
the tokens it writes. A request ends on the writer's own EOS ids, on a stop string in the text,
at the writer's context, or when the text holds ``max_new_tokens`` tokens of the last model's
vocabulary (counted by encoding the whole text). The engine re-encodes only a window at each
handoff and keeps each model's KV across them; its outputs equal these, byte for byte.
"""

from __future__ import annotations

import torch

from .engine.core import policy_host as PH
from .engine.core.sampler import make_generator, sample
from .policy import Policy, Resample, StepBatch
from .reference import GREEDY, MAX_RESAMPLES, _last
from .request import RequestView, SamplingParams, prompt_key


def reference_generate_text(
    models: dict, text, prompts: dict[str, list[int]], policy: Policy, params: SamplingParams, *, rid: int = 0, key=None
) -> dict:
    """Generate one request over models that do not share a tokenizer.

    Args:
        models: name -> model, smallest first (as given to the Router).
        text: the models' `tokenrouter_sdk.engine.core.text_mode.Vocabularies` (``router.text``:
            per model its tokenizer, `ByteVocab`, EOS ids and the ids it never writes).
        prompts: per model its prompt ids (``Router.encode(prompt, model=m)``).
        policy: the policy (its per-request state starts empty).
        params: sampling parameters (greedy, or seeded sampling: the same per-(seed, model)
            generators as the engine).
        rid: request id the policy sees.
        key: the request key the policy sees (default: the engine's default key of a prompt
            that is the first of its kind in its call: of the last model's prompt ids).

    Returns:
        dict with ``data`` (the committed bytes), ``text`` (the output text, cut before a stop
        string), ``token_ids`` and ``token_models`` (each id in its writer's vocabulary),
        ``hops``, ``discarded``, ``finish_reason``, ``stop_reason``, ``units`` (the text's
        tokens in the last model's vocabulary) and ``views`` (per model its tokens of the
        output when the request ended, None for a model it never reached).

    Raises:
        ValueError: the policy returned an unknown model.
        RuntimeError: more than 16 `Resample` decisions in a row.
    """
    names = list(models)
    unit = text.vocabs[names[-1]]
    key = prompt_key(prompts[names[-1]]) if key is None else key
    limits = {n: min(m.get_output_embeddings().weight.shape[0], len(text.tokenizers[n])) for n, m in models.items()}
    ctx = {n: int(getattr(m.config, "max_position_embeddings", 1 << 30)) for n, m in models.items()}
    gens = {n: make_generator(params.seed, i, next(models[n].parameters()).device) for i, n in enumerate(names)}
    state: dict = {}
    data = bytearray()
    views: dict[str, list[int] | None] = dict.fromkeys(names)
    out: list[int] = []
    who: list[str] = []
    hops = discarded = 0
    span, return_to = None, None
    stop_reason = None
    entry_view = RequestView(
        rid=rid,
        prompt_ids=list(prompts[names[-1]]),
        output_ids=[],
        owner="",
        state=state,
        hops=0,
        models=tuple(names),
        key=key,
    )
    owner = PH.call_entry(policy, entry_view, names) or names[0]
    views[owner] = []

    def view():
        return RequestView(
            rid=rid,
            prompt_ids=list(prompts[owner]),
            output_ids=list(views[owner]),
            owner=owner,
            state=state,
            hops=hops,
            models=tuple(names),
            key=key,
            text_of=data.decode("utf-8", "replace"),
        )

    def commit(tok) -> str | None:
        nonlocal stop_reason
        out.append(tok)
        who.append(owner)
        views[owner].append(tok)
        data.extend(text.vocabs[owner].table[tok])
        if tok in text.eos[owner] and not params.ignore_eos:
            return "eos"
        if params.stop:
            whole = data.decode("utf-8", "replace")
            hits = [(whole.find(x), x) for x in params.stop if x in whole]
            if hits:
                stop_reason = min(hits)[1]
                return "stop"
        if len(prompts[owner]) + len(views[owner]) >= ctx[owner]:
            return "length"
        if len(unit.encode(bytes(data))) >= params.max_new_tokens:
            return "length"
        return None

    def receive(target) -> str | None:
        views[target] = text.vocabs[target].encode(bytes(data))
        return "length" if len(prompts[target]) + len(views[target]) >= ctx[target] else None

    greedy = False  # after a Handoff(greedy=True), until the next handoff
    while True:
        logits, hidden, all_hidden = _last(models[owner], list(prompts[owner]) + views[owner])
        logits = logits[: limits[owner]]
        banned = [i for i in text.banned.get(owner, ()) if i < limits[owner]]
        if banned:
            logits = logits.index_fill(0, torch.tensor(banned, dtype=torch.long), float("-inf"))
        p = GREEDY if greedy else params
        tok = int(sample(logits[None], [p], [gens[owner]])[0])
        if span is not None:
            span -= 1
            reason = commit(tok)
            if reason:
                break
            if span == 0:
                owner, span, return_to = return_to, None, None
                hops += 1
                greedy = False
                reason = receive(owner)
                if reason:
                    break
            continue
        first = hops == 0 and not out
        prompt_h = all_hidden[: len(prompts[owner])] if first else None
        resamples = 0
        while True:
            step_batch = StepBatch(
                owner,
                names,
                torch.tensor([tok]),
                logits[None],
                hidden[None],
                [view()],
                text.tokenizers[owner],
                needs=policy.needs,
                policy=repr(policy),
                peer_logits=[None],
                prompt_hidden=[prompt_h],
            )
            dec = PH.call_route_batch(policy, step_batch, 1)[0]
            if isinstance(dec, BaseException):
                raise dec
            tok = int(step_batch.tokens[0])
            if not isinstance(dec, Resample):
                break
            resamples += 1
            if resamples > MAX_RESAMPLES:
                raise RuntimeError(f"policy resampled {resamples} times in a row")
            discarded += 1
            tok = int(sample(logits[None], [p], [gens[owner]])[0])
        dec = PH.route_decision(dec, names, owner)
        if dec == owner:
            reason = commit(tok)
            if reason:
                break
            continue
        h = PH.call_send(policy, view(), dec)
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
        greedy = bool(h.greedy)
        reason = receive(owner)
        if reason:
            break
        PH.call_receive(policy, h, view())
    shown = bytearray()
    for t, m in zip(out, who):
        if params.ignore_eos or t not in text.eos[m]:
            shown.extend(text.vocabs[m].table[t])
    final = shown.decode("utf-8", "replace")
    if params.stop:
        hits = [(final.find(x), x) for x in params.stop if x in final]
        if hits:
            final = final[: min(hits)[0]]
    return {
        "data": bytes(data),
        "text": final,
        "token_ids": out,
        "token_models": who,
        "hops": hops,
        "discarded": discarded,
        "finish_reason": reason,
        "stop_reason": stop_reason,
        "units": len(unit.encode(bytes(data))),
        "views": views,
    }
