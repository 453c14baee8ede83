"""Answers as coloured tokens: per-token text pieces and their HTML (static and live views).

Each committed token is a ``<span class="tr-tok">`` whose background is the colour of the model
that wrote it (inline style, so it survives notebook sanitisers and exported HTML). Discarded
tokens (sampled, then dropped on a handoff: ``RequestOutput.discarded_log``) are
``<span class="tr-disc">`` elements, struck through, hidden until the reader ticks the page's
"show discarded tokens" box (pure CSS, no JavaScript) or, live, presses the toggle button.
"""

from __future__ import annotations

import html

PALETTE = ["#9ecae9", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94"]
"""Background colours of models, smallest first (light tones: the text stays readable)."""

STRONG = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
"""Line/bar colours of models in the figures, in the same order as `PALETTE`."""

CSS = """
.tr-root{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:13px;line-height:1.6}
.tr-root .tr-legend span{padding:1px 6px;margin-right:6px;border-radius:3px}
.tr-root .tr-ans{white-space:pre-wrap;margin:6px 0 10px 0;padding:6px;border-left:3px solid #ddd}
.tr-root .tr-head{font-weight:600;color:#444}
.tr-root .tr-tok{border-radius:2px}
.tr-root .tr-disc{display:none;text-decoration:line-through;opacity:.55;outline:1px dashed #999}
.tr-root input.tr-toggle:checked ~ .tr-answers .tr-disc{display:inline}
"""


def model_color(models: list[str], model: str, strong: bool = False) -> str:
    """The colour of ``model`` (by its index in ``models``; unknown models get grey)."""
    pal = STRONG if strong else PALETTE
    return pal[models.index(model) % len(pal)] if model in models else "#cccccc"


def token_pieces(tokenizer, ids: list[int], start: int = 0, window: int = 8) -> list[str]:
    """Text of each token of ``ids[start:]`` as it reads inside the whole sequence.

    A piece is ``decode(ids[w:i+1]) - decode(ids[w:i])`` over a short window ``w = i - window``,
    so leading spaces survive; a token that ends inside a multi-byte character gets ``""`` and
    the token completing the character carries it. Special tokens decode to ``""``.

    Returns:
        ``len(ids) - start`` strings.
    """
    out = []
    for i in range(start, len(ids)):
        w = max(0, i - window)
        prev = tokenizer.decode(ids[w:i], skip_special_tokens=True).rstrip("\ufffd") if i > w else ""
        text = tokenizer.decode(ids[w : i + 1], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            out.append("")
        else:
            out.append(text[len(prev) :] if text.startswith(prev) else text)
    return out


def legend_html(models: list[str]) -> str:
    return (
        '<div class="tr-legend">'
        + "".join(f'<span style="background:{model_color(models, m)}">{html.escape(m)}</span>' for m in models)
        + "</div>"
    )


def answer_html(
    pieces: list[str],
    token_models: list[str],
    models: list[str],
    discarded=(),
    discarded_pieces=(),
    title: str = "",
    show_discarded: bool | None = None,
) -> str:
    """One answer as coloured spans.

    Args:
        pieces, token_models: text and writer of each committed token (same length).
        models: all model names (colour order).
        discarded: ``(position, token_id, model)`` per dropped token (``discarded_log``).
        discarded_pieces: the text of each dropped token (same length as ``discarded``).
        title: a header line (e.g. ``"req 3 · eos · 2 hops"``).
        show_discarded: None: hidden unless the page's CSS toggle is ticked; True/False: an
            inline style forces them shown/hidden (the live view's button).
    """
    at: dict[int, list[int]] = {}
    for k, (pos, _tok, _m) in enumerate(discarded):
        at.setdefault(pos, []).append(k)
    parts = []
    for i in range(len(pieces) + 1):
        for k in at.get(i, ()):
            _pos, tok, m = discarded[k]
            txt = discarded_pieces[k] if k < len(discarded_pieces) else f"<{tok}>"
            style = f"background:{model_color(models, m)};" + ("display:inline;" if show_discarded else "")
            parts.append(
                f'<span class="tr-disc" title="discarded: sampled by {html.escape(m)}, id {tok}" '
                f'style="{style}">{html.escape(txt) or "&#8203;"}</span>'
            )
        if i < len(pieces):
            m = token_models[i]
            parts.append(
                f'<span class="tr-tok" data-model="{html.escape(m)}" title="{html.escape(m)} · token {i}" '
                f'style="background:{model_color(models, m)}">{html.escape(pieces[i])}</span>'
            )
    head = f'<div class="tr-head">{html.escape(title)}</div>' if title else ""
    return f'{head}<div class="tr-ans">{"".join(parts)}</div>'


def page_html(answers: list[str], models: list[str], toggle_id: str = "tr-toggle", toggle: bool = True) -> str:
    """The answers under a legend and (with ``toggle``) a CSS-only "show discarded tokens"
    checkbox; a self-contained ``<div>`` with its own ``<style>``."""
    box = (
        (
            f'<input type="checkbox" class="tr-toggle" id="{toggle_id}"> '
            f'<label for="{toggle_id}">show discarded tokens</label>'
        )
        if toggle
        else ""
    )
    return (
        f'<div class="tr-root"><style>{CSS}</style>{legend_html(models)}{box}'
        f'<div class="tr-answers">{"".join(answers)}</div></div>'
    )


def byte_pieces(ids: list[int], writers: list[str], vocabs: dict) -> list[str]:
    """Text of each token of an output written by models that do not share a tokenizer: each
    token's bytes (its writer's `tokenrouter_sdk.byte_vocab.ByteVocab`) through one incremental
    UTF-8 decoder, so a token that ends inside a character gets ``""`` and the one completing it
    carries it; the pieces join to the output's text."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out = [dec.decode(vocabs[m].table[t]) for t, m in zip(ids, writers)]
    if out:
        out[-1] += dec.decode(b"", final=True)
    return out


def output_pieces(out, tokenizer, vocabs: dict | None = None) -> tuple[list[str], list[str]]:
    """(text of each committed token, text of each discarded token) of a `RequestOutput`;
    ``vocabs`` (model -> `ByteVocab`) for models that do not share a tokenizer."""
    log = list(getattr(out, "discarded_log", ()) or ())
    if vocabs is not None:
        return (
            byte_pieces(list(out.token_ids), list(out.token_models), vocabs),
            [vocabs[m].table[tok].decode("utf-8", "replace") for _pos, tok, m in log],
        )
    return (
        token_pieces(tokenizer, list(out.token_ids)),
        [_piece_at(tokenizer, out.token_ids, pos, tok) for pos, tok, _m in log],
    )


def output_title(out) -> str:
    """The header of an answer: its index in the call (``RequestOutput.index``), how it ended,
    its length and hops."""
    return f"req {out.index} · {out.finish_reason or 'running'} · {len(out.token_ids)} tokens · {out.hops} hops"


def output_html(
    out,
    pieces: tuple[list[str], list[str]],
    models: list[str],
    show_discarded: bool | None = None,
    title: str | None = None,
) -> str:
    """`answer_html` of one `RequestOutput`, given its `output_pieces`."""
    log = list(getattr(out, "discarded_log", ()) or ())
    return answer_html(
        pieces[0],
        list(out.token_models),
        models,
        log,
        pieces[1],
        output_title(out) if title is None else title,
        show_discarded,
    )


def _piece_at(tokenizer, ids, pos: int, tok: int) -> str:
    """The text ``tok`` would have had at output position ``pos``."""
    return token_pieces(tokenizer, list(ids[max(0, pos - 8) : pos]) + [int(tok)], start=min(pos, 8))[0]
