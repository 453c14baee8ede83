"""Query-level router training: which prompts the small model answers correctly (RouteLLM,
arXiv 2406.18665, trains on preference labels; here the label is the small model's own
correctness). The head is
`policies/query_level.py`'s `QueryHead`: p = P(small correct | h), h = the small model's last
hidden state at the last prompt token (what `QueryRouter` sees at the first step).

Labels: the small model answers each prompt greedily (``max_new_tokens``); with
``reference="gold"`` (default) label 1 iff ``check(answer, example)`` (default
`tokenrouter_sdk.train.data.is_correct`: the final answer against the gold one with
`tokenrouter_sdk.eval.answers`, math-verify). With ``reference="large"`` the large model answers
too and label 1 iff the two final answers agree (`tokenrouter_sdk.eval.answers_agree`): "the
small model's answer is as good as the large one's", RouteLLM's preference label (a win or tie
of the weak model) read off the answers; for pairs whose small model is almost never right
(the packaged CPU pair answers 1 of 128 GSM8K training questions correctly), it is the label
with both classes.
Training: standardise h with the training mean / std (stored in the head), then BCE on
logistic regression (``hidden_dim=0``) or a one-hidden-layer MLP, AdamW with weight decay.
Threshold: `QueryRouter` sends a prompt to the large model when p < threshold; the threshold is
the quantile of p over all training prompts that sends ``large_share`` of them there (RouteLLM
calibrates by score quantiles too).
"""

from __future__ import annotations

import time
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
    threshold_for_rate,
    write_run,
)
from .data import as_examples, is_correct, split


class _Logit(torch.nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h):
        return self.head.net((h - self.head.mu) / self.head.sigma).squeeze(-1)


def train_query(
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
    check: Callable = is_correct,
    reference: str = "gold",
    large_share: float = 0.5,
    hidden_dim: int = 0,
    val_fraction: float = 0.25,
    epochs: int = 200,
    lr: float = 1e-2,
    weight_decay: float = 1e-2,
    batch_size: int = 256,
    patience: int = 30,
    seed: int = 0,
    concurrency: int = 16,
    progress: bool = True,
) -> TrainResult:
    """Label prompts by the small model's correctness and train a `QueryHead`; save it where
    `QueryRouter` reads it.

    Args:
        router_or_models, tokenizer, prompts, data, limit, out, name: as in `train_r2r`.
        max_new_tokens: length of the small model's answers (tokens).
        check: ``check(answer_text, example) -> bool`` (``reference="gold"``).
        reference: ``"gold"`` (label = the small answer is correct) or ``"large"`` (label = the
            small and large models' final answers agree), see the module docstring.
        large_share: share of training prompts the threshold sends to the large model.
        hidden_dim: 0 = logistic regression, else the MLP's hidden width.

    Returns:
        `TrainResult` (``threshold``; ``metrics``: small-model accuracy, validation AUC and
        accuracy of p >= 0.5 against the labels).

    Raises:
        ValueError: the small model answered all prompts correctly or none (one class: nothing
            to learn; use more prompts, a longer ``max_new_tokens``, ``reference="large"`` or a
            stronger small model), or an unknown ``reference``.
    """
    if reference not in ("gold", "large"):
        raise ValueError(f"train_query: reference must be 'gold' or 'large', got {reference!r}")
    from tqdm.auto import tqdm

    from .data import DEFAULT_DATA, load_examples

    examples = as_examples(prompts) if prompts is not None else load_examples(data, limit, offset=offset)
    train, val = split(examples, val_fraction, seed)
    hyper = {
        k: v
        for k, v in locals().items()
        if k
        in (
            "max_new_tokens",
            "large_share",
            "hidden_dim",
            "val_fraction",
            "epochs",
            "lr",
            "weight_decay",
            "batch_size",
            "patience",
            "seed",
        )
    }
    hyper["check"] = (
        getattr(check, "__qualname__", str(check))
        if reference == "gold"
        else "tokenrouter_sdk.eval.answers_agree(small answer, large answer)"
    )
    hyper["reference"] = reference
    t0 = time.perf_counter()
    allx = train + val
    with Pair(router_or_models, tokenizer) as pair:
        ids = [pair.encode(e.prompt) for e in allx]
        outs = pair.generate(ids, "small", max_new_tokens=max_new_tokens, concurrency=concurrency, progress=progress)
        if reference == "gold":
            y = torch.tensor([float(bool(check(o.text, e))) for o, e in zip(outs, allx)])
        else:
            from tokenrouter_sdk.eval.answers import answers_agree, extract_answer

            ref = pair.generate(ids, "large", max_new_tokens=max_new_tokens, concurrency=concurrency, progress=progress)
            y = torch.tensor(
                [float(answers_agree(extract_answer(o.text), extract_answer(r.text))) for o, r in zip(outs, ref)]
            )
        h = torch.stack(
            [
                forward_features(pair.small, p)[0][-1]
                for p in tqdm(ids, desc="query: prompt states", disable=not progress)
            ]
        )
        meta = base_meta("query", pair, train, val, (data or DEFAULT_DATA) if prompts is None else None, hyper)
    t_label = time.perf_counter() - t0
    n_tr = len(train)
    if y.sum() in (0, len(y)):
        what = "correctly" if reference == "gold" else "as the large model did"
        raise ValueError(
            f"train_query: the small model answered {int(y.sum())} of {len(y)} prompts {what}; a "
            "router needs both outcomes. Use more prompts, a larger max_new_tokens, "
            "reference='large' or a stronger small model"
        )
    from tokenrouter_sdk.policies.query_level import QueryHead

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = QueryHead(h.shape[1], hidden_dim)
    with torch.no_grad():
        head.mu.copy_(h[:n_tr].mean(0))
        head.sigma.copy_(h[:n_tr].std(0).clamp_min(1e-6) if n_tr > 1 else torch.ones(h.shape[1]))
    net = _Logit(head)
    hist = fit_bce(
        net,
        (h[:n_tr],),
        y[:n_tr],
        val=((h[n_tr:],), y[n_tr:]) if len(val) else None,
        epochs=epochs,
        lr=lr,
        weight_decay=weight_decay,
        batch_size=batch_size,
        patience=patience,
        seed=seed,
        progress=progress,
        desc="query: train",
    )
    head.eval()
    with torch.no_grad():
        p = head(h)
    thr = threshold_for_rate(p, large_share, above=False)
    pv, yv = p[n_tr:], y[n_tr:]
    metrics = {
        "small_accuracy" if reference == "gold" else "small_agrees_with_large": float(y.mean()),
        "labels": {"prompts": len(y), "positive": int(y.sum()), "reference": reference},
        "val": (binary_metrics(pv >= 0.5, yv) | {"auc": auc(pv, yv)}) if len(val) else {},
        "large_share_train": float((p < thr).float().mean()),
        "label_s": t_label,
        "train_s": time.perf_counter() - t0 - t_label,
    }
    meta |= {
        "metrics": metrics,
        "threshold": thr,
        "threshold_rule": f"quantile of p sending {large_share} of the training prompts to the large model",
        "history": hist,
        "labels_per_prompt": {e.id: int(v) for e, v in zip(allx, y.tolist())},
        "usage": "QueryRouter(head, threshold=...)",
    }
    head_path, js = write_run("query", out, head.state_dict(), head.config, meta, name)
    return TrainResult(
        "query", head_path, js, thr, metrics, meta, hist, data=((h[:n_tr], y[:n_tr]), (h[n_tr:], y[n_tr:]))
    )
