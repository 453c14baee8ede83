"""CITER router training: token labels from gold answers and a BCE-trained confidence MLP
(CITER, arXiv 2502.01976; aiming-lab/CITER ``get_gt_first_iter.py``, ``mlp_training.py``). The head is
`policies/citer.py`'s `ConfidenceHead`.

Labels, teacher-forcing the gold chain of thought (``Example.solution``) after the prompt, at
each gold position t:
- 1 if the small model's greedy token equals the gold token ("small is fine");
- else 0 if the large model's greedy token equals it ("the large model is needed");
- else a rollout decides: from prompt + gold[:t] + the small model's token the small model
  continues greedily (``rollout_tokens``), and the label is 1 iff the final answer of
  gold[:t] + token + rollout is correct (CITER's first iteration; its later iterations roll out
  with S+L under the current router, which is not done here). At most ``max_rollouts`` such
  positions per example are rolled out (a seeded sample); the others are left out of the data.
With ``reference="large"`` the teacher-forced text is the large model's own greedy response
(``max_new_tokens`` tokens) instead of the gold one, and a rollout is "correct" iff its final
answer agrees with the large model's (`tokenrouter_sdk.eval.answers_agree`): the router learns to
reproduce the large model, the target when the large model itself is rarely right (the packaged
CPU pair: 2 of 800 gold-check rollouts were correct). Along the large model's greedy path its own
prediction equals the reference token, so every position where the small model differs is
labelled 0 and rollouts are not needed.
Training: BCE on the head's logit, AdamW (CITER's README uses Adam, lr 1e-7 on large data;
here lr 1e-3), early stopping on validation questions. Threshold: route when c < tau, with tau
the smallest value that reaches ``recall`` of the label-0 ("large needed") positions on
validation (R2R's rule applied to 1 - c); CITER's own default is a fixed 0.95.
"""

from __future__ import annotations

import random
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
    reference_texts,
    teacher_forced,
    threshold_below_for_recall,
    threshold_for_rate,
    write_run,
)
from .data import Example, as_examples, is_correct, split


@dataclass
class CiterData:
    """Labelled gold positions: hidden [N, H] (small model, position producing the token),
    label [N] (1 = small fine), reason [N] (0 small right, 1 large right, 2 rollout),
    example [N], position [N]; rollouts: per rolled-out position its text and verdict."""

    hidden: torch.Tensor
    label: torch.Tensor
    reason: torch.Tensor
    example: torch.Tensor
    position: torch.Tensor
    rollouts: list = field(default_factory=list)

    def counts(self) -> dict:
        return {
            "rows": len(self.label),
            "small_right": int((self.reason == 0).sum()),
            "large_right": int((self.reason == 1).sum()),
            "rollout": int((self.reason == 2).sum()),
            "rollout_correct": int(((self.reason == 2) & (self.label == 1)).sum()),
        }

    def select(self, examples: set[int]) -> "CiterData":
        m = torch.tensor([int(e) in examples for e in self.example], dtype=torch.bool)
        return CiterData(self.hidden[m], self.label[m], self.reason[m], self.example[m], self.position[m])


def label_citer(
    pair: Pair,
    examples: list[Example],
    *,
    rollout_tokens: int = 96,
    max_rollouts: int = 4,
    max_gold_tokens: int = 256,
    check: Callable = is_correct,
    seed: int = 0,
    concurrency: int = 16,
    reference: str = "gold",
    max_new_tokens: int = 96,
    cache=None,
    progress: bool = False,
) -> CiterData:
    """CITER labels for every position of the reference text (see the module docstring).

    Raises:
        ValueError: an unknown ``reference``, a gold example without a solution, or no row.
    """
    refs = reference_texts(
        pair,
        examples,
        reference,
        max_new_tokens=max_new_tokens,
        concurrency=concurrency,
        cache=cache,
        progress=progress,
    )
    if reference == "large":
        from tokenrouter_sdk.eval.answers import answers_agree, extract_answer

        large_answer = [extract_answer(pair.tokenizer.decode(g, skip_special_tokens=True)) for g in refs]

    def verdict(text: str, i: int) -> bool:
        if reference == "large":
            return answers_agree(extract_answer(text), large_answer[i])
        return bool(check(text, examples[i]))

    rng = random.Random(seed)
    rows, jobs = [], []  # rows: [ex, t, h, label, reason]; jobs: (row, prompt ids, gold prefix + token)
    for i, p, g, hs, ls, ll in teacher_forced(
        pair, examples, refs, max_gold_tokens, "CITER: teacher forcing", progress
    ):
        s_pred, l_pred = ls.argmax(-1), ll.argmax(-1)
        hard = [t for t in range(len(g)) if int(s_pred[t]) != g[t] and int(l_pred[t]) != g[t]]
        roll = set(rng.sample(hard, min(max_rollouts, len(hard))))
        for t in range(len(g)):
            if int(s_pred[t]) == g[t]:
                rows.append([i, t, hs[t], 1.0, 0])
            elif int(l_pred[t]) == g[t]:
                rows.append([i, t, hs[t], 0.0, 1])
            elif t in roll:
                rows.append([i, t, hs[t], 0.0, 2])
                jobs.append((len(rows) - 1, p + g[:t] + [int(s_pred[t])], g[:t] + [int(s_pred[t])]))
    limit = pair.router.max_context - 1
    gen = [j for j in jobs if len(j[1]) < limit]
    outs = pair.generate(
        [j[1] for j in gen], "small", max_new_tokens=rollout_tokens, concurrency=concurrency, progress=progress
    )
    rollouts = []
    for (r, _, prefix), o in zip(gen, outs):
        text = pair.tokenizer.decode(prefix + list(o.token_ids), skip_special_tokens=True)
        i = rows[r][0]
        ok = verdict(text, i)
        rows[r][3] = float(ok)
        rollouts.append({"example": examples[i].id, "t": rows[r][1], "text": text[-300:], "correct": ok})
    done = {j[0] for j in gen}
    rows = [x for n, x in enumerate(rows) if x[4] != 2 or n in done]
    if not rows:
        raise ValueError("CITER labelling produced no rows (empty gold solutions?)")
    return CiterData(
        torch.stack([x[2] for x in rows]),
        torch.tensor([x[3] for x in rows]),
        torch.tensor([x[4] for x in rows]),
        torch.tensor([x[0] for x in rows]),
        torch.tensor([x[1] for x in rows]),
        rollouts,
    )


class _Logit(torch.nn.Module):
    """ConfidenceHead -> the logit before its sigmoid, [N]."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h):
        return self.head.linear(self.head.mlp(h)).squeeze(-1)


def train_citer(
    router_or_models,
    prompts=None,
    *,
    tokenizer=None,
    data=None,
    limit: int | None = None,
    offset: int = 0,
    out="heads",
    name: str | None = None,
    rollout_tokens: int = 96,
    max_rollouts: int = 4,
    max_gold_tokens: int = 256,
    check: Callable = is_correct,
    recall: float = 0.95,
    val_fraction: float = 0.25,
    epochs: int = 50,
    lr: float = 1e-3,
    weight_decay: float = 5e-4,
    batch_size: int = 256,
    patience: int = 10,
    seed: int = 0,
    concurrency: int = 16,
    reference: str = "gold",
    max_new_tokens: int = 96,
    cache=None,
    progress: bool = True,
) -> TrainResult:
    """Label CITER data from gold answers and train the confidence head; save it where `CITER`
    reads it.

    Args:
        router_or_models, tokenizer, prompts, data, limit, out, name: as in `train_r2r`; prompts
            must carry gold solutions (GSM8K rows do).
        rollout_tokens: bound of each rollout (tokens); max_rollouts: rollouts per example.
        max_gold_tokens: gold responses are cut to this many tokens.
        check: ``check(text, example) -> bool``, the answer check of the rollouts
            (default: `tokenrouter_sdk.train.data.is_correct`).
        recall: tau reaches this recall of label-0 positions (route when c < tau) on validation.
        reference: ``"gold"`` (teacher-force the gold solutions, rollouts checked against the
            gold answer) or ``"large"`` (the large model's greedy responses of ``max_new_tokens``
            tokens, rollouts checked for agreement with its answer); see the module docstring.
        cache: a folder where the large model's responses are kept and reused (None: none).

    Returns:
        `TrainResult` (``threshold`` = tau; ``metrics``: validation precision/recall of routing
        on label-0 positions, AUC of 1 - c).

    Raises:
        ValueError: an example without a gold solution (``reference="gold"``), an unknown
            ``reference``, or no label-0 position in validation.
    """
    from .data import DEFAULT_DATA, load_examples

    examples = as_examples(prompts) if prompts is not None else load_examples(data, limit, offset=offset)
    train, val = split(examples, val_fraction, seed)
    hyper = {
        k: v
        for k, v in locals().items()
        if k
        in (
            "rollout_tokens",
            "max_rollouts",
            "max_gold_tokens",
            "recall",
            "val_fraction",
            "epochs",
            "lr",
            "weight_decay",
            "batch_size",
            "patience",
            "seed",
            "reference",
        )
    }
    if reference == "large":
        hyper["max_new_tokens"] = max_new_tokens
    hyper["check"] = (
        getattr(check, "__qualname__", str(check))
        if reference == "gold"
        else "tokenrouter_sdk.eval.answers_agree(rollout answer, large answer)"
    )
    t0 = time.perf_counter()
    with Pair(router_or_models, tokenizer) as pair:
        d = label_citer(
            pair,
            train + val,
            rollout_tokens=rollout_tokens,
            max_rollouts=max_rollouts,
            max_gold_tokens=max_gold_tokens,
            check=check,
            seed=seed,
            concurrency=concurrency,
            reference=reference,
            max_new_tokens=max_new_tokens,
            cache=cache,
            progress=progress,
        )
        meta = base_meta("citer", pair, train, val, (data or DEFAULT_DATA) if prompts is None else None, hyper)
    t_label = time.perf_counter() - t0
    from tokenrouter_sdk.policies.citer import ConfidenceHead

    tr, va = d.select(set(range(len(train)))), d.select(set(range(len(train), len(examples))))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ConfidenceHead(d.hidden.shape[1])
    net = _Logit(head)
    hist = fit_bce(
        net,
        (tr.hidden,),
        tr.label,
        val=((va.hidden,), va.label),
        epochs=epochs,
        lr=lr,
        weight_decay=weight_decay,
        batch_size=batch_size,
        patience=patience,
        seed=seed,
        progress=progress,
        desc="CITER: train",
    )
    with torch.no_grad():
        c_val = head(va.hidden)
    need = 1 - va.label  # positive class = "large needed"
    tau = threshold_below_for_recall(c_val, need, recall)
    metrics = {
        "val": binary_metrics(c_val < tau, need) | {"auc": auc(1 - c_val, need)},
        "tau_at_large_fraction_0.2": threshold_for_rate(c_val, 0.2, above=False),
        "labels": d.counts(),
        "train_rows": len(tr.label),
        "val_rows": len(va.label),
        "label_s": t_label,
        "train_s": time.perf_counter() - t0 - t_label,
    }
    meta |= {
        "metrics": metrics,
        "threshold": tau,
        "threshold_rule": f"route when c < tau; tau reaches recall >= {recall} of label-0 positions on val",
        "history": hist,
        "rollouts_sample": d.rollouts[:10],
        "usage": "CITER(head, tau=...)",
    }
    head_path, js = write_run(
        "citer", out, head.state_dict(), {"threshold": tau, "hidden_size": d.hidden.shape[1]}, meta, name
    )
    return TrainResult("citer", head_path, js, tau, metrics, meta, hist, data=(tr, va))
