"""Co-LLM deferral head training (Learning to Decode Collaboratively, arXiv 2403.03870, sec. 2-3;
clinicalml/co-llm ``collm/training/deferral_training_tools.py``, ``collm/dataset/initialization.py``).
The head is `policies/co_llm.py`'s `DeferralHead` (pi_t = sigmoid(g . h_t + b) on the small model's last hidden state).

Data: the gold chain of thought (``Example.solution``) teacher-forced after the prompt; per gold
token x_t the small model's hidden state h_t, log p_S(x_t) and the large model's log p_L(x_t)
(the "static dataset" the assistant scores once).
1. Weak-supervision initialisation (Co-LLM's ``initialization.py``): BCE of pi_t against the
   pseudo-label 1 iff argmax p_L == x_t and argmax p_S != x_t (``init_epochs`` epochs).
2. Marginal likelihood with the small model frozen (only g and b train; Co-LLM fine-tunes the
   whole base model jointly, which this approximates):
       loss = -mean_t log[(1 - pi_t) p_S(x_t) + pi_t p_L(x_t)].
3. Threshold eta by Youden's J (max TPR - FPR of the rule pi > eta) on validation questions,
   labels = (the large model's greedy token != the small model's greedy token), as Co-LLM's
   threshold search does (it uses 15 validation samples).
With ``reference="large"`` the text is the large model's own greedy response (``max_new_tokens``
tokens) instead of the gold one: the marginal likelihood then rewards deferring exactly where the
small model would not write the large model's token, so the head learns to reproduce the large
model (the packaged CPU pair's large model answers 1.6% of GSM8K correctly in 96 tokens, and on
gold text it out-predicts the small one almost everywhere: 85% deferral on validation). On
the large model's own greedy tokens p_L is close to 1, so the marginal likelihood grows with pi
almost everywhere and drives pi to 1 (the packaged pair: pi > 0.99999 on most rows, AUC 0.66 for
"greedy tokens differ"); the weak-supervision stage alone (``epochs=0``) keeps a usable ranking
(AUC 0.83), and is how the packaged head was trained.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .common import (
    Pair,
    TrainResult,
    auc,
    base_meta,
    binary_metrics,
    fit_bce,
    reference_texts,
    teacher_forced,
    threshold_youden,
    write_run,
)
from .data import Example, as_examples, split


def features_co_llm(
    pair: Pair,
    examples: list[Example],
    *,
    max_gold_tokens: int = 256,
    reference: str = "gold",
    max_new_tokens: int = 96,
    concurrency: int = 16,
    cache=None,
    progress: bool = False,
) -> dict:
    """Per position of the reference text (gold, or the large model's response with
    ``reference="large"``, see `reference_texts`): ``hidden`` [N, H], ``lp_small``/``lp_large``
    (log-probs of the reference token, [N]), ``small_greedy``/``large_greedy``/``gold`` (the
    reference token) ids [N], ``example`` [N]."""
    refs = reference_texts(
        pair,
        examples,
        reference,
        max_new_tokens=max_new_tokens,
        concurrency=concurrency,
        cache=cache,
        progress=progress,
    )
    cols = {k: [] for k in ("hidden", "lp_small", "lp_large", "small_greedy", "large_greedy", "gold", "example")}
    for i, _, g, hs, ls, ll in teacher_forced(
        pair, examples, refs, max_gold_tokens, "Co-LLM: teacher forcing", progress
    ):
        gt = torch.tensor(g)
        lps, lpl = torch.log_softmax(ls, -1), torch.log_softmax(ll, -1)
        cols["hidden"].append(hs)
        cols["lp_small"].append(lps.gather(1, gt[:, None])[:, 0])
        cols["lp_large"].append(lpl.gather(1, gt[:, None])[:, 0])
        cols["small_greedy"].append(lps.argmax(-1))
        cols["large_greedy"].append(lpl.argmax(-1))
        cols["gold"].append(gt)
        cols["example"].append(torch.full((len(g),), i))
    if not cols["gold"]:
        raise ValueError("Co-LLM: no gold tokens (empty solutions?)")
    return {k: torch.cat(v) for k, v in cols.items()}


def marginal_nll(z: torch.Tensor, lp_small: torch.Tensor, lp_large: torch.Tensor) -> torch.Tensor:
    """-log[(1 - sigmoid(z)) p_S + sigmoid(z) p_L] per row, computed in log space, [N]."""
    return -torch.logaddexp(F.logsigmoid(-z) + lp_small, F.logsigmoid(z) + lp_large)


class _Z(torch.nn.Module):
    """DeferralHead -> the deferral logit g . h + b, [N] (extra inputs ignored)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, h, *_):
        return h @ self.head.g + self.head.b


def train_co_llm(
    router_or_models,
    prompts=None,
    *,
    tokenizer=None,
    data=None,
    limit: int | None = None,
    offset: int = 0,
    out="heads",
    name: str | None = None,
    max_gold_tokens: int = 256,
    val_fraction: float = 0.25,
    init_epochs: int = 10,
    epochs: int = 50,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    batch_size: int = 256,
    patience: int = 10,
    seed: int = 0,
    reference: str = "gold",
    max_new_tokens: int = 96,
    concurrency: int = 16,
    cache=None,
    progress: bool = True,
) -> TrainResult:
    """Train a Co-LLM deferral head on gold answers (or the large model's); save it where `CoLLM`
    reads it.

    Args:
        router_or_models, tokenizer, prompts, data, limit, out, name: as in `train_r2r`; prompts
            must carry gold solutions.
        init_epochs: epochs of weak-supervision BCE before the marginal likelihood (0 = none).
        epochs, lr, weight_decay, batch_size, patience: the marginal-likelihood stage (AdamW).
        reference: ``"gold"`` (the gold solutions) or ``"large"`` (the large model's greedy
            responses of ``max_new_tokens`` tokens, generated ``concurrency`` at a time and kept in
            ``cache``, a folder, when given); see the module docstring.

    Raises:
        ValueError: an unknown ``reference``, or a gold example without a solution.

    Returns:
        `TrainResult` (``threshold`` = eta; ``metrics``: validation marginal NLL against
        small-only / large-only NLL, AUC and precision/recall of pi > eta for "greedy tokens
        differ", deferral rate). ``history`` holds both stages (``init`` and ``marginal``).
    """
    from .data import DEFAULT_DATA, load_examples

    examples = as_examples(prompts) if prompts is not None else load_examples(data, limit, offset=offset)
    train, val = split(examples, val_fraction, seed)
    hyper = {
        k: v
        for k, v in locals().items()
        if k
        in (
            "max_gold_tokens",
            "val_fraction",
            "init_epochs",
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
    t0 = time.perf_counter()
    with Pair(router_or_models, tokenizer) as pair:
        f = features_co_llm(
            pair,
            train + val,
            max_gold_tokens=max_gold_tokens,
            reference=reference,
            max_new_tokens=max_new_tokens,
            concurrency=concurrency,
            cache=cache,
            progress=progress,
        )
        meta = base_meta("co_llm", pair, train, val, (data or DEFAULT_DATA) if prompts is None else None, hyper)
    t_label = time.perf_counter() - t0
    from tokenrouter_sdk.policies.co_llm import DeferralHead

    is_tr = f["example"] < len(train)
    T = {k: v[is_tr] for k, v in f.items()}
    V = {k: v[~is_tr] for k, v in f.items()}
    head = DeferralHead(f["hidden"].shape[1])
    net = _Z(head)
    pseudo = lambda d: ((d["large_greedy"] == d["gold"]) & (d["small_greedy"] != d["gold"])).float()  # noqa: E731
    hist = {"init": None}
    if init_epochs:
        hist["init"] = fit_bce(
            net,
            (T["hidden"],),
            pseudo(T),
            val=((V["hidden"],), pseudo(V)),
            epochs=init_epochs,
            lr=lr,
            weight_decay=weight_decay,
            batch_size=batch_size,
            patience=patience,
            seed=seed,
            progress=progress,
            desc="Co-LLM: weak init",
        )
    ml = lambda z, xs, y: marginal_nll(z, xs[1], xs[2]).mean()  # noqa: E731
    inputs = lambda d: (d["hidden"], d["lp_small"], d["lp_large"])  # noqa: E731
    hist["marginal"] = fit_bce(
        net,
        inputs(T),
        T["gold"].float(),
        val=(inputs(V), V["gold"].float()),
        epochs=epochs,
        lr=lr,
        weight_decay=weight_decay,
        batch_size=batch_size,
        patience=patience,
        seed=seed + 1,
        loss_fn=ml,
        progress=progress,
        desc="Co-LLM: marginal likelihood",
    )
    with torch.no_grad():
        z = net(V["hidden"])
        pi = torch.sigmoid(z)
        differ = (V["large_greedy"] != V["small_greedy"]).float()
        eta = threshold_youden(pi, differ)
        metrics = {
            "val": binary_metrics(pi > eta, differ) | {"auc": auc(pi, differ)},
            "val_nll": {
                "marginal": float(marginal_nll(z, V["lp_small"], V["lp_large"]).mean()),
                "small_only": float(-V["lp_small"].mean()),
                "large_only": float(-V["lp_large"].mean()),
            },
            "deferral_rate_val": float((pi > eta).float().mean()),
            "train_rows": int(is_tr.sum()),
            "val_rows": int((~is_tr).sum()),
            "label_s": t_label,
            "train_s": time.perf_counter() - t0 - t_label,
        }
    meta |= {
        "metrics": metrics,
        "threshold": eta,
        "threshold_rule": "eta maximising Youden's J of pi > eta for 'greedy tokens differ' on val",
        "history": hist,
        "usage": "CoLLM(head, eta=...)",
    }
    head_path, js = write_run("co_llm", out, head.state_dict(), {"threshold": eta}, meta, name)
    return TrainResult("co_llm", head_path, js, eta, metrics, meta, hist, data=(T, V))
