"""What committing one token does to a request on the model that writes it, and which rule ends
the request: the one place the sub-server's stop rules live.

`commit_token` (models sharing one tokenizer) appends the token and checks, in order: inside a
forced output (teacher forcing) only the length; then the request's stop token ids, the EOS ids
(unless ``ignore_eos``), the stop strings (in the decoded output) and the length
(``max_new_tokens`` or the model's context). `commit_text` (models that do not share a
tokenizer, docs/mixed-vocabularies.md) appends the token's bytes and checks this model's EOS
ids, the stop strings (in the bytes), the context and ``max_new_tokens`` counted in the unit
model's tokens of the text. Both update the request's counters (`RequestState`) and report why
it ended; the sub-server emits the events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...byte_vocab import char_count

if TYPE_CHECKING:
    from .scheduler import Seq
    from .text_mode import TextMode

__all__ = ["commit_token", "commit_text", "given_tokens", "logprobs"]


def commit_token(s: Seq, tok: int, model: str, max_context: int, tokenizer) -> tuple[str | None, object]:
    """Commit ``tok`` to ``s`` on ``model`` (one shared tokenizer): ``(finish reason or None,
    stop reason)``; the stop reason is the stop token id or the stop string found, else None."""
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
    elif p.stop and (why := _hit_stop(s, tokenizer)) is not None:
        reason = "stop"
    elif s.request_state.n_committed >= p.max_new_tokens or len(s.tokens) >= max_context:
        reason = "length"
    return reason, why


def commit_text(
    text: TextMode, s: Seq, tok: int, model: str, max_context: int
) -> tuple[str | None, str | None, int, int | None]:
    """Commit ``tok`` to ``s`` on ``model`` (models that do not share a tokenizer): its bytes
    join the committed output; this model's EOS ids, the stop strings (in the text), the context
    and ``max_new_tokens`` (the unit model's tokens of the text) end the request, in that order.
    Returns ``(finish reason or None, stop string or None, characters that begin in the token's
    bytes, the output's tokens in the unit model's vocabulary when counted, else None)``."""
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
    reason, why, units = None, None, None
    if tok in text.eos_ids and not p.ignore_eos:
        reason = "eos"
    elif p.stop and (why := _hit_stop_text(s, len(data))) is not None:
        reason = "stop"
    elif len(s.tokens) >= max_context:
        reason = "length"
    elif request_state.n_bytes >= p.max_new_tokens:  # a token writes at least one byte: fewer bytes, fewer tokens
        units = _count_units(text, s)
        reason = "length" if units >= p.max_new_tokens else None
    if reason is not None and units is None:
        units = _count_units(text, s)
    return reason, why, char_count(data), units


def _count_units(text: TextMode, s: Seq) -> int:
    """The committed text's tokens in the unit model's vocabulary (`ByteVocab.count`; the
    count's stable boundary travels with the request)."""
    request_state = s.request_state
    request_state.units, request_state.unit_at, request_state.unit_base = text.unit.count(
        s.text.data, request_state.unit_at, request_state.unit_base
    )
    return request_state.units


def _hit_stop_text(s: Seq, added: int) -> str | None:
    """The stop string the committed text now holds in its end (the last ``added`` bytes
    plus enough before them to hold the longest stop string), or None."""
    stops = s.config.params.stop
    span = max(len(x.encode("utf-8")) for x in stops) + added + 3
    tail = bytes(s.text.data[-span:]).decode("utf-8", "replace")
    hits = [(tail.find(x), x) for x in stops if x in tail]
    return min(hits)[1] if hits else None


def _hit_stop(s: Seq, tokenizer) -> str | None:
    """The stop string the output's text now contains (decoded as the final text is: special
    tokens skipped), or None. Only the tail is decoded: enough tokens to hold the longest
    stop string plus the characters one token may add."""
    stops = s.config.params.stop
    longest = max(len(x) for x in stops)
    out = s.output_ids
    n = longest + 8
    while True:
        tail = tokenizer.decode(out[-n:], skip_special_tokens=True)
        if len(tail) >= longest + 8 or n >= len(out):
            break
        n *= 2
    hits = [(tail.find(x), x) for x in stops if x in tail]
    return min(hits)[1] if hits else None


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
