"""R2R router training: path-following labels and a BCE-trained router (Roads to Rome,
arXiv 2505.21600, Alg. 1 "path-following routing"; thu-nics/R2R ``script/data_labeling/step_*``).
The head is the network `policies/r2r.py` reads (``RouterNet``: small last hidden state, sampled-token embedding,
top-k logits).

Labelling, per training prompt:
0. the large model L writes a greedy response (``max_new_tokens``);
1. the small model S prefills prompt + response (teacher forcing); at each response position t
   S's greedy prediction s_t is compared with L's token l_t: equal -> label 0 ("identical");
2. at up to ``max_branches`` differing positions per response (a seeded sample) L continues
   greedily from prefix + s_t, at most ``branch_tokens`` tokens, to a sentence boundary. The other branch, prefix +
   l_t, needs no generation: under greedy
   decoding L's continuation of it *is* the rest of L's response;
3. a verifier decides whether the two branch sentences are neutral (label 0) or divergent (1).
   The differing positions not branched are, with ``unverified="drop"`` (default), left out of
   the data (the label prior shifts towards identical tokens), or with
   ``unverified="divergent"`` kept and labelled 1 (R2R's labelling branches every differing
   position; labelling the rest divergent keeps the prior and costs no generation, and most
   branched differences are divergent: 251 of 288 in the first packaged head's data).

Default verifier (`rule_verifier`, a cheap stated rule instead of R2R's 72B LLM judge): the
branches are *divergent* unless they carry the same numbers in the same order AND either their
normalised words (lower-case alphanumerics) are equal or they re-converge (same last two words).
Any callable ``verifier(context, a, b) -> bool`` (True = divergent) works.

Training: BCE-with-logits, AdamW (R2R: lr 5e-5, wd 5e-4, batch 1024, 50 epochs, patience 10 on
a 56M-parameter router; defaults here are sized for a few thousand CPU rows: hidden_dims
(256, 256), lr 1e-3). The threshold tau is the largest value with recall >= ``recall`` (default
0.95) on validation questions (R2R's ``optimizing.min_recall``), saved as the head's
``config["threshold"]`` which `R2R` reads.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .common import (
    Pair,
    TrainResult,
    auc,
    base_meta,
    binary_metrics,
    fit_bce,
    forward_features,
    reference_responses,
    threshold_for_rate,
    threshold_for_recall,
    write_run,
)
from .data import Example, as_examples, split

STOPS = ("\n", ". ", "? ", "! ")
_END = re.compile(r"[.!?](?=\s)|\n")
_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"[a-z0-9]+")
_SEP = re.compile(r"(?<=\d),(?=\d{3})")


def first_sentence(text: str) -> str:
    """``text`` up to and including its first sentence end (``.``/``!``/``?`` before whitespace,
    or a newline) after its first non-blank character; all of it when there is none."""
    start = len(text) - len(text.lstrip())
    m = _END.search(text, start + 1) if start < len(text) else None
    return text[: m.end()] if m else text


def numbers(text: str) -> list[str]:
    """Numbers in order, thousands separators dropped (``1,200`` -> ``1200``)."""
    return _NUM.findall(_SEP.sub("", text))


def words(text: str) -> list[str]:
    """Lower-case alphanumeric words."""
    return _WORD.findall(_SEP.sub("", text.lower()))


def rule_verifier(context: str, a: str, b: str) -> bool:
    """The default verifier: True (divergent) unless ``a`` and ``b`` carry the same numbers in
    order and their words are equal or end with the same two words (the branches re-converged)."""
    if numbers(a) != numbers(b):
        return True
    wa, wb = words(a), words(b)
    if wa == wb:
        return False
    return not (len(wa) >= 2 and len(wb) >= 2 and wa[-2:] == wb[-2:])


@dataclass
class R2RData:
    """Labelled positions (rows) of R2R labelling.

    Attributes:
        hidden: S's last hidden state at the position producing each token, [N, H] float32.
        token: S's greedy token there (the sampled token at inference), [N] int64.
        topk: S's top-k next-token logits, sorted descending, [N, k] float32.
        label: 1 = divergent (or unverified, kept as divergent), 0 = identical or neutral, [N] float32.
        kind: 0 identical, 1 neutral, 2 divergent, 3 differing but not branched, [N] int64.
        example: index of the example of each row, [N].
        position: response position t of each row, [N].
        branches: per verified position: example id, t, s/l token, the two branch sentences, verdict.
        responses: L's response token ids per example.
    """

    hidden: torch.Tensor
    token: torch.Tensor
    topk: torch.Tensor
    label: torch.Tensor
    kind: torch.Tensor
    example: torch.Tensor
    position: torch.Tensor
    branches: list = field(default_factory=list)
    responses: list = field(default_factory=list)

    def counts(self) -> dict:
        return {
            "rows": len(self.label),
            "identical": int((self.kind == 0).sum()),
            "neutral": int((self.kind == 1).sum()),
            "divergent": int((self.kind == 2).sum()),
            "unverified": int((self.kind == 3).sum()),
        }

    def select(self, examples: set[int]) -> "R2RData":
        m = torch.tensor([int(e) in examples for e in self.example], dtype=torch.bool)
        return R2RData(
            self.hidden[m], self.token[m], self.topk[m], self.label[m], self.kind[m], self.example[m], self.position[m]
        )


def label_r2r(
    pair: Pair,
    examples: list[Example],
    *,
    max_new_tokens: int = 128,
    branch_tokens: int = 32,
    max_branches: int = 8,
    logits_size: int = 100,
    verifier: Callable | None = None,
    seed: int = 0,
    concurrency: int = 16,
    unverified: str = "drop",
    cache=None,
    progress: bool = False,
) -> R2RData:
    """Label every response position of the large model's greedy answers (see the module
    docstring). ``cache``: a folder for the large model's responses (`reference_responses`).
    Returns `R2RData`; rows of examples in order, positions ascending.

    Raises:
        ValueError: ``unverified`` is not ``"drop"`` or ``"divergent"``, or no row at all.
    """
    from tqdm.auto import tqdm

    if unverified not in ("drop", "divergent"):
        raise ValueError(f"unverified must be 'drop' or 'divergent', got {unverified!r}")
    verifier = verifier or rule_verifier
    tok, eos = pair.tokenizer, pair.tokenizer.eos_token_id
    prompts = [pair.encode(e.prompt) for e in examples]
    responses = reference_responses(
        pair, prompts, max_new_tokens=max_new_tokens, concurrency=concurrency, cache=cache, progress=progress
    )
    k = min(logits_size, pair.small.config.vocab_size)
    rows, jobs, unv = [], [], []  # rows: (ex, t, h, s_tok, topk, l_tok); jobs: (row index, branch prompt)
    rng = random.Random(seed)
    for i, (p, r) in enumerate(tqdm(list(zip(prompts, responses)), desc="R2R: small prefill", disable=not progress)):
        if not r:
            continue
        h, logits = forward_features(pair.small, p + r)
        P = len(p)
        h, logits = h[P - 1 : P - 1 + len(r)], logits[P - 1 : P - 1 + len(r)]
        s_pred = logits.argmax(-1)
        z = torch.topk(logits, k, dim=-1).values
        differ = [t for t in range(len(r)) if int(s_pred[t]) != r[t]]
        chosen = set(sorted(rng.sample(differ, min(max_branches, len(differ)))))
        for t in range(len(r)):
            same = int(s_pred[t]) == r[t]
            if same or t in chosen or unverified == "divergent":
                rows.append([i, t, h[t], int(s_pred[t]), z[t], r[t]])
                if t in chosen:
                    jobs.append((len(rows) - 1, p + r[:t] + [int(s_pred[t])]))
                elif not same:
                    unv.append(len(rows) - 1)
    limit = pair.router.max_context - 1
    gen = [(j, ids) for j, ids in jobs if rows[j][3] != eos and len(ids) < limit]
    conts = pair.generate(
        [ids for _, ids in gen],
        "large",
        max_new_tokens=branch_tokens,
        stop=STOPS,
        concurrency=concurrency,
        progress=progress,
    )
    cont = {j: list(o.token_ids) for (j, _), o in zip(gen, conts)}
    kinds = [0] * len(rows)
    for j in unv:
        kinds[j] = 3
    branches = []
    for j, _ in jobs:
        i, t, _, s_tok, _, l_tok = rows[j]
        r = responses[i]
        a = first_sentence(tok.decode([s_tok] + cont.get(j, []), skip_special_tokens=True))
        b = first_sentence(tok.decode(r[t : t + branch_tokens + 1], skip_special_tokens=True))
        context = tok.decode(r[:t], skip_special_tokens=True)
        div = bool(verifier(context, a, b))
        kinds[j] = 2 if div else 1
        branches.append(
            {
                "example": examples[i].id,
                "t": t,
                "small_token": s_tok,
                "large_token": l_tok,
                "small_branch": a,
                "large_branch": b,
                "divergent": div,
            }
        )
    if not rows:
        raise ValueError("R2R labelling produced no rows: the large model wrote empty responses")
    kind = torch.tensor(kinds)
    return R2RData(
        torch.stack([x[2] for x in rows]),
        torch.tensor([x[3] for x in rows]),
        torch.stack([x[4] for x in rows]),
        (kind >= 2).float(),
        kind,
        torch.tensor([x[0] for x in rows]),
        torch.tensor([x[1] for x in rows]),
        branches,
        responses,
    )


def build_router_net(
    hidden_size: int,
    embed_size: int,
    logits_size: int,
    hidden_dims=(256, 256),
    expansion_factor: int = 4,
    seed: int = 0,
):
    """An untrained `RouterNet` with R2R's block layout (blocks d_i -> expansion*d_i -> d_{i+1})."""
    from tokenrouter_sdk.policies.r2r import RouterNet

    dims = list(hidden_dims) + [hidden_dims[-1]]
    blocks = [(dims[i], dims[i] * expansion_factor, dims[i + 1]) for i in range(len(hidden_dims))]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RouterNet(hidden_size, embed_size, logits_size, blocks)


def train_r2r(
    router_or_models,
    prompts=None,
    *,
    tokenizer=None,
    data=None,
    limit: int | None = None,
    offset: int = 0,
    out="heads",
    name: str | None = None,
    max_new_tokens: int = 128,
    branch_tokens: int = 32,
    max_branches: int = 8,
    verifier: Callable | None = None,
    recall: float = 0.95,
    val_fraction: float = 0.25,
    hidden_dims=(256, 256),
    epochs: int = 50,
    lr: float = 1e-3,
    weight_decay: float = 5e-4,
    batch_size: int = 256,
    patience: int = 10,
    pos_weight: float | None = None,
    seed: int = 0,
    concurrency: int = 16,
    unverified: str = "drop",
    cache=None,
    progress: bool = True,
) -> TrainResult:
    """Label R2R data with the pair and train the router; save it where `R2R` reads it.

    Args:
        router_or_models: a `Router` (first model small, last large) or ``{"small": m, "large": M}``
            with ``tokenizer``.
        prompts: training prompts (strings, dicts or `Example`); None = ``load_examples(data, limit)``
            (``data`` None: GSM8K train, shipped with the package; ``data="gsm8k"``: GSM8K test
            without its 128 held-out questions, what the packaged heads used); ``offset`` skips the dataset's
            first rows (`load_examples`).
        out, name: the head goes to ``<out>/<name>.pt`` and its record to ``<out>/<name>.json``
            (name default ``r2r_head``).
        max_new_tokens: length of L's responses (tokens); branch_tokens: bound of each branch
            continuation (tokens); max_branches: verified differing positions per response.
        verifier: ``verifier(context, a, b) -> bool`` (True = divergent); default `rule_verifier`.
        unverified: differing positions beyond ``max_branches``: ``"drop"`` them or keep them
            labelled ``"divergent"`` (see the module docstring).
        cache: a folder where the large model's responses are kept and reused (None: none).
        concurrency: generation batch (requests in flight).
        recall: target recall of divergent tokens on validation for tau.
        val_fraction: share of questions held out for validation (threshold, early stopping).
        hidden_dims, epochs, lr, weight_decay, batch_size, patience, pos_weight: training.

    Returns:
        `TrainResult` (``threshold`` = tau; ``metrics``: validation precision/recall/AUC at tau).

    Raises:
        ValueError: no divergent label in the validation questions (use more prompts, larger
            ``max_branches`` or another verifier), or an unknown ``unverified``.
    """
    from .data import DEFAULT_DATA, load_examples

    examples = as_examples(prompts) if prompts is not None else load_examples(data, limit, offset=offset)
    train, val = split(examples, val_fraction, seed)
    hyper = {
        k: v
        for k, v in locals().items()
        if k
        in (
            "max_new_tokens",
            "branch_tokens",
            "max_branches",
            "recall",
            "val_fraction",
            "hidden_dims",
            "epochs",
            "lr",
            "weight_decay",
            "batch_size",
            "patience",
            "pos_weight",
            "seed",
            "unverified",
        )
    }
    hyper["verifier"] = getattr(verifier, "__name__", type(verifier).__name__) if verifier else "rule_verifier"
    t0 = time.perf_counter()
    with Pair(router_or_models, tokenizer) as pair:
        d = label_r2r(
            pair,
            train + val,
            max_new_tokens=max_new_tokens,
            branch_tokens=branch_tokens,
            max_branches=max_branches,
            verifier=verifier,
            seed=seed,
            concurrency=concurrency,
            unverified=unverified,
            cache=cache,
            progress=progress,
        )
        t_label = time.perf_counter() - t0
        table = pair.small.get_input_embeddings().weight.detach()
        meta = base_meta("r2r", pair, train, val, (data or DEFAULT_DATA) if prompts is None else None, hyper)
    tr, va = d.select(set(range(len(train)))), d.select(set(range(len(train), len(examples))))
    emb = lambda x: table[x.token].float()  # noqa: E731
    net = build_router_net(d.hidden.shape[1], table.shape[1], d.topk.shape[1], hidden_dims, seed=seed)
    fwd = _Scorer(net)
    hist = fit_bce(
        fwd,
        (tr.hidden, emb(tr), tr.topk),
        tr.label,
        val=((va.hidden, emb(va), va.topk), va.label),
        epochs=epochs,
        lr=lr,
        weight_decay=weight_decay,
        batch_size=batch_size,
        pos_weight=pos_weight,
        patience=patience,
        seed=seed,
        progress=progress,
        desc="R2R: train",
    )
    with torch.no_grad():
        p_val = torch.sigmoid(fwd(va.hidden, emb(va), va.topk))
    tau = threshold_for_recall(p_val, va.label, recall)
    metrics = {
        "val": binary_metrics(p_val >= tau, va.label) | {"auc": auc(p_val, va.label)},
        "tau_at_large_fraction_0.2": threshold_for_rate(p_val, 0.2, above=True),
        "labels": d.counts(),
        "train_rows": len(tr.label),
        "val_rows": len(va.label),
        "label_s": t_label,
        "train_s": time.perf_counter() - t0 - t_label,
    }
    meta |= {
        "metrics": metrics,
        "threshold": tau,
        "threshold_rule": f"largest tau with recall >= {recall} on val",
        "history": hist,
        "branches_sample": d.branches[:20],
        "usage": "R2R(head, embedding=<the small model>, tau=...) (the token table is not stored)",
    }
    head, js = write_run("r2r", out, net.state_dict(), {"threshold": tau}, meta, name)
    return TrainResult("r2r", head, js, tau, metrics, meta, hist, table, (tr, va))


class _Scorer(torch.nn.Module):
    """RouterNet -> one logit per row, [N]."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, h, e, z):
        return self.net(h, e, z)[:, 0]
