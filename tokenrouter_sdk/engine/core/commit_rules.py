"""What committing one token does to a request on the model that writes it, and which rule ends
the request: the one place the sub-server's stop rules live.

`commit_token` (models sharing one tokenizer) appends the token and checks, in order: inside a
forced output (teacher forcing) only the length; then the request's stop token ids, the EOS ids
(unless ``ignore_eos``) and the length (``max_new_tokens`` or the model's context).
`commit_text` (models that do not share a tokenizer, docs/mixed-vocabularies.md) appends the
token's bytes and checks this model's EOS ids, the context and ``max_new_tokens`` counted in the
unit model's tokens of the text. Both update the request's counters (`RequestState`) and report
why it ended; the sub-server emits the events. Stop strings are not a rule here: they are found
where the text is made (`RequestHandle.commit`, in the engine), which then ends the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...byte_vocab import char_count

if TYPE_CHECKING:
    from .scheduler import Seq
    from .text_mode import TextMode

__all__ = ["commit_token", "commit_text", "given_tokens", "logprobs"]


def commit_token(s: Seq, tok: int, model: str, max_context: int) -> tuple[str | None, int | None]:
    """Commit ``tok`` to ``s`` on ``model`` (one shared tokenizer): ``(finish reason or None,
    the stop token id that ended it or None)``."""
    s.tokens.append(tok)
    s.request_state.seen[model] = len(s.tokens)
    s.request_state.n_committed += 1
    s.request_state.hops_since_commit = s.resamples = 0
    p = s.config.params
    reason, why = None, None
    if s.request_state.n_committed <= len(s.config.forced):
        if s.request_state.n_committed >= p.max_new_tokens or len(s.tokens) >= max_context:
            reason = "length"
    elif tok in p.stop_token_ids:
        reason, why = "stop", tok
    elif tok in s.config.eos_ids and not p.ignore_eos:
        reason = "eos"
    elif s.request_state.n_committed >= p.max_new_tokens or len(s.tokens) >= max_context:
        reason = "length"
    return reason, why


def commit_text(text: TextMode, s: Seq, tok: int, model: str, max_context: int) -> tuple[str | None, int, int | None]:
    """Commit ``tok`` to ``s`` on ``model`` (models that do not share a tokenizer): its bytes
    join the committed output; this model's EOS ids, the context and ``max_new_tokens`` (the
    unit model's tokens of the text) end the request, in that order. Returns ``(finish reason
    or None, characters that begin in the token's bytes, the output's tokens in the unit model's
    vocabulary when counted, else None)``."""
    data = text.vocab.table[tok]
    s.tokens.append(tok)
    s.text.append(data)
    request_state = s.request_state
    request_state.n_bytes += len(data)
    request_state.seen_bytes[model] = request_state.n_bytes
    request_state.seen[model] = len(s.tokens)
    request_state.n_committed += 1
    request_state.hops_since_commit = s.resamples = 0
    p = s.config.params
    reason, units = None, None
    if tok in text.eos_ids and not p.ignore_eos:
        reason = "eos"
    elif len(s.tokens) >= max_context:
        reason = "length"
    elif request_state.n_bytes >= p.max_new_tokens:  # a token writes at least one byte: fewer bytes, fewer tokens
        units = _count_units(text, s)
        reason = "length" if units >= p.max_new_tokens else None
    if reason is not None and units is None:
        units = _count_units(text, s)
    return reason, char_count(data), units


def _count_units(text: TextMode, s: Seq) -> int:
    """The committed text's tokens in the unit model's vocabulary (`ByteVocab.count`; the
    count's stable boundary travels with the request)."""
    request_state = s.request_state
    request_state.units, request_state.unit_at, request_state.unit_base = text.unit.count(
        s.text.data, request_state.unit_at, request_state.unit_base
    )
    return request_state.units


def logprobs(row: torch.Tensor, tok: int, k: int) -> tuple:
    """``(log-probability of tok, ((token, logprob), ...) of the k most likely)`` under the
    logits ``row`` [V] (natural log; float64 logits stay float64)."""
    lp = torch.log_softmax(row if row.dtype == torch.float64 else row.float(), -1)
    top = ()
    if k:
        vals, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return float(lp[tok]), top


def given_tokens(batch: list[Seq], tokens: list[int], idx) -> list[int]:
    """``tokens`` (one per row of ``idx`` of ``batch``) with the given token of every request
    still inside its forced output (`RequestConfig.forced`: teacher forcing) in place of the
    drawn one (in place; returned)."""
    for j, i in enumerate(idx):
        forced, pos = batch[i].config.forced, batch[i].request_state.n_committed
        if pos < len(forced):
            tokens[j] = forced[pos]
    return tokens
