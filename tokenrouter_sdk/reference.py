"""The naive reference: recompute the whole prefix on every step, no KV cache, no batching,
one request at a time, applying the same policy. It defines what the engine must produce: with
greedy decoding, the engine's tokens equal these (with seeded sampling too, on float64 models).

It applies every hook of the policy surface (`tokenrouter_sdk.policy`) the plain way: greedy
decoding after ``Handoff(greedy=True)`` until the next handoff, the source's logits handed to
the target's next step (``Needs(handoff_logits=True)``, discarding handoffs), a token a policy
sets with ``set_token``, `Resample` (a new draw from the same logits, routed again) and the
prompt's hidden states at the first step (``Needs(prompt_hidden=True)``). With ``forced`` tokens
(teacher forcing, `Router.score`) each output position writes its given token on the model the
policy routes it to; every committed token's log-probability under the model that wrote it is
recorded (``logprobs``), and `reference_logprobs` recomputes those of any output from scratch."""

from __future__ import annotations

import torch

from .engine.core import policy_host as PH
from .engine.core.sampler import make_generator, sample
from .policy import Policy, Resample, StepBatch
from .request import RequestView, SamplingParams, prompt_key

GREEDY = SamplingParams()
MAX_RESAMPLES = 16  # EngineConfig.max_hops_without_commit's default


@torch.inference_mode()
def _last(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(last-position logits [V], last hidden [H], every position's hidden [n, H]) from the
    model's own causal-LM forward (whatever it does after the LM head, e.g. Gemma's final-logit
    soft-capping, included). The decoder's output is caught by a hook held for this call only
    (``output_hidden_states`` would leave transformers' capturing hooks on the layers)."""
    dev = next(model.parameters()).device
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    seen = []
    hook = dec.register_forward_hook(lambda mod, args, out: seen.append(out.last_hidden_state[0]))
    try:
        logits = model(input_ids=torch.tensor([ids], device=dev), use_cache=False, logits_to_keep=1).logits[0, -1]
    finally:
        hook.remove()
    hs = seen[-1]
    return logits, hs[-1], hs


def reference_generate(
    models: dict,
    prompt_ids: list[int],
    policy: Policy,
    params: SamplingParams,
    *,
    eos_ids: tuple[int, ...] = (),
    rid: int = 0,
    tokenizer=None,
    key=None,
    vocab_limit: int | None = None,
    forced=(),
) -> dict:
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
        forced: output tokens given in advance: position i writes ``forced[i]`` instead of a
            draw (a `Resample` there keeps it), and no stop rule but the length ends the
            request inside them.

    Returns:
        dict with ``token_ids``, ``token_models``, ``hops``, ``discarded``, ``finish_reason``,
        ``logits`` (the last-position logits of every step, for tolerance checks) and
        ``logprobs`` (per committed token its log-probability under the model that wrote it).

    Raises:
        ValueError: the policy returned an unknown model.
        RuntimeError: more than 16 `Resample` decisions in a row.
    """
    names = list(models)
    key = prompt_key(prompt_ids) if key is None else key
    limit = vocab_limit or min(
        [m.get_output_embeddings().weight.shape[0] for m in models.values()]
        + ([len(tokenizer)] if tokenizer is not None else [])
    )
    max_ctx = min(int(getattr(m.config, "max_position_embeddings", 1 << 30)) for m in models.values())
    gens = {n: make_generator(params.seed, i, next(models[n].parameters()).device) for i, n in enumerate(names)}
    state: dict = {}
    forced = list(forced)
    lps: list[float] = []
    out: list[int] = []
    who: list[str] = []
    hops = discarded = 0
    span, return_to = None, None
    all_logits = []
    entry_view = RequestView(
        rid=rid, prompt_ids=list(prompt_ids), output_ids=[], owner="", state=state, hops=0, models=tuple(names), key=key
    )
    owner = PH.call_entry(policy, entry_view, names) or names[0]

    def view():
        return RequestView(
            rid=rid,
            prompt_ids=list(prompt_ids),
            output_ids=list(out),
            owner=owner,
            state=state,
            hops=hops,
            models=tuple(names),
            key=key,
        )

    def commit(tok) -> str | None:
        out.append(tok)
        who.append(owner)
        lps.append(float(torch.log_softmax(logits.double(), -1)[tok]))
        if len(out) <= len(forced):
            return "length" if len(out) >= params.max_new_tokens or len(prompt_ids) + len(out) >= max_ctx else None
        if tok in params.stop_token_ids:
            return "stop"
        if tok in eos_ids and not params.ignore_eos:
            return "eos"
        if len(out) >= params.max_new_tokens or len(prompt_ids) + len(out) >= max_ctx:
            return "length"
        return None

    greedy = False  # after a Handoff(greedy=True), until the next handoff
    peer = None  # the source's logits for the position the owner writes next
    while True:
        logits, hidden, all_hidden = _last(models[owner], list(prompt_ids) + out)
        logits = logits[:limit]
        all_logits.append(logits)
        p = GREEDY if greedy else params
        tok = int(sample(logits[None], [p], [gens[owner]])[0])
        given = len(out) < len(forced)
        if given:
            tok = forced[len(out)]
        step_peer, peer = peer, None
        if span is not None:
            span -= 1
            reason = commit(tok)
            if reason:
                break
            if span == 0:
                owner, span, return_to = return_to, None, None
                hops += 1
                greedy = False
            continue
        first = hops == 0 and not out
        prompt_h = all_hidden[: len(prompt_ids)] if first else None
        resamples = 0
        while True:
            step_batch = StepBatch(
                owner,
                names,
                torch.tensor([tok]),
                logits[None],
                hidden[None],
                [view()],
                tokenizer,
                needs=policy.needs,
                policy=repr(policy),
                peer_logits=[step_peer],
                prompt_hidden=[prompt_h],
            )
            dec = PH.call_route_batch(policy, step_batch, 1)[0]
            if isinstance(dec, BaseException):
                raise dec
            tok = forced[len(out)] if given else int(step_batch.tokens[0])
            if given and isinstance(dec, Resample):
                dec = owner
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
            if getattr(policy.needs, "handoff_logits", False):
                peer = logits
        if h.span is not None:
            span, return_to = h.span, owner
        owner = dec
        hops += 1
        greedy = bool(h.greedy)
        PH.call_receive(policy, h, view())
    return {
        "token_ids": out,
        "token_models": who,
        "hops": hops,
        "discarded": discarded,
        "finish_reason": reason,
        "logits": all_logits,
        "logprobs": lps,
    }


@torch.inference_mode()
def reference_logprobs(
    models: dict,
    prompt_ids: list[int],
    token_ids: list[int],
    token_models: list[str],
    *,
    top: int = 0,
    vocab_limit: int | None = None,
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per output token, ``(its log-probability, the top alternatives [(token, logprob), ...])``
    under the model that wrote it, recomputed from scratch: model ``token_models[i]`` runs the
    whole prompt + ``token_ids[:i]`` (no KV cache) and scores ``token_ids[i]`` from its
    last-position distribution over the first ``vocab_limit`` tokens (default: the smallest
    vocabulary of the models), in float64.

    Raises:
        ValueError: ``token_ids`` and ``token_models`` differ in length.
    """
    if len(token_ids) != len(token_models):
        raise ValueError(f"{len(token_ids)} tokens but {len(token_models)} writers")
    limit = vocab_limit or min(m.get_output_embeddings().weight.shape[0] for m in models.values())
    out = []
    for i, (tok, who) in enumerate(zip(token_ids, token_models)):
        logits = _last(models[who], list(prompt_ids) + list(token_ids[:i]))[0][:limit]
        lp = torch.log_softmax(logits.double(), -1)
        alts = []
        if top:
            vals, ids = torch.topk(lp, top)
            alts = list(zip(ids.tolist(), vals.tolist()))
        out.append((float(lp[tok]), alts))
    return out
