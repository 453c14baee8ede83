"""Shared plumbing of the training pipelines: the model pair, teacher-forced features, batched
generation through the engine, a BCE training loop, ranking metrics, threshold rules, and the
run record (head file + JSON) behind `TrainResult`."""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn


# -- the model pair ------------------------------------------------------------------------------
class Pair:
    """The small and large model, their tokenizer and a `Router` for batched greedy generation.

    Built from a `Router` (its first model is small, its last large; generation goes through it)
    or from ``{"small": m1, "large": m2}`` / ``(small, large)`` plus ``tokenizer`` (a threaded
    Router is made here and closed by `close`). Use as a context manager.
    """

    def __init__(self, router_or_models, tokenizer=None, *, max_kv_tokens: int = 16384):
        from tokenrouter_sdk.router import Router

        if isinstance(router_or_models, Router):
            self.router, self._own = router_or_models, False
        else:
            models = router_or_models
            if isinstance(models, (tuple, list)):
                if len(models) != 2:
                    raise ValueError(f"give (small, large): got {len(models)} models")
                models = {"small": models[0], "large": models[1]}
            if not isinstance(models, dict) or len(models) < 2:
                raise ValueError(
                    "training needs a Router or {'small': model, 'large': model} (two models, "
                    "small first) plus tokenizer=..."
                )
            if tokenizer is None:
                raise ValueError("models given as objects: pass tokenizer=... too")
            self.router = Router(models, tokenizer=tokenizer, processes=False, max_kv_tokens=max_kv_tokens)
            self._own = True
        names = list(self.router.models)
        self.small_name, self.large_name = names[0], names[-1]
        self.small, self.large = self.router.models[self.small_name], self.router.models[self.large_name]
        self.tokenizer = self.router.tokenizer

    def encode(self, prompt: str) -> list[int]:
        """Prompt token ids as the Router builds them (chat template when the tokenizer has one)."""
        return self.router.encode(prompt)

    def generate(
        self,
        prompt_ids: list[list[int]],
        model: str,
        *,
        max_new_tokens: int,
        stop=(),
        concurrency: int = 16,
        progress: bool = False,
    ) -> list:
        """Greedy answers of one model (``"small"``/``"large"``) -> list of `RequestOutput`."""
        from tokenrouter_sdk.policies import LargeOnly, SmallOnly

        if not prompt_ids:
            return []
        pol = SmallOnly() if model == "small" else LargeOnly()
        outs = self.router.generate(
            [list(p) for p in prompt_ids],
            policy=pol,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            stop=tuple(stop),
            concurrency=concurrency,
            progress=progress,
        )
        bad = [o for o in outs if not o.ok]
        if bad:
            raise RuntimeError(f"generation on the {model} model failed: {bad[0].error}")
        return outs

    def describe(self) -> dict:
        """The pair for ``meta``: per model its class, source name, layers, hidden size, dtype, params."""

        def one(m):
            c = m.config
            return {
                "class": type(m).__name__,
                "name_or_path": str(getattr(c, "_name_or_path", "") or ""),
                "num_hidden_layers": int(c.num_hidden_layers),
                "hidden_size": int(c.hidden_size),
                "vocab_size": int(c.vocab_size),
                "dtype": str(next(m.parameters()).dtype),
                "parameters": int(sum(p.numel() for p in m.parameters())),
            }

        shared = {id(p) for p in self.small.parameters()} & {id(p) for p in self.large.parameters()}
        return {"small": one(self.small), "large": one(self.large), "shared_parameter_tensors": len(shared)}

    def close(self) -> None:
        if self._own:
            self.router.close()

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_fingerprint(model) -> str:
    """A short hash of a model's parameter values (float64 sums per tensor), for cache keys."""
    import hashlib

    with torch.no_grad():
        sums = [f"{n}:{float(p.detach().double().sum()):.10e}" for n, p in model.named_parameters()]
    return hashlib.sha256("\n".join(sums).encode()).hexdigest()[:16]


def reference_responses(
    pair: Pair,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    concurrency: int = 16,
    cache=None,
    progress: bool = False,
) -> list[list[int]]:
    """The large model's greedy responses (token ids, at most ``max_new_tokens`` each) to
    ``prompt_ids``: the paths R2R labels along, and the reference text CITER and Co-LLM
    teacher-force with ``reference="large"``.

    Args:
        cache: a folder, or None. With a folder the responses are kept there as JSON, keyed by a
            hash of the large model's parameter values, the prompt ids and ``max_new_tokens``, so
            the pipelines trained on the same questions generate them once.

    Returns:
        One token-id list per prompt, in order.

    Raises:
        RuntimeError: a generation failed.
    """
    import hashlib

    path = None
    if cache is not None:
        key = json.dumps(
            {"large": model_fingerprint(pair.large), "prompts": prompt_ids, "max_new_tokens": max_new_tokens}
        )
        path = Path(cache) / f"large_responses_{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        if path.exists():
            return [list(r) for r in json.loads(path.read_text())]
    outs = pair.generate(prompt_ids, "large", max_new_tokens=max_new_tokens, concurrency=concurrency, progress=progress)
    responses = [list(o.token_ids) for o in outs]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(responses))
        tmp.replace(path)
    return responses


def gold_ids(pair: Pair, ex) -> list[int]:
    """Token ids of the example's gold response (``Example.solution``); ValueError if it has none."""
    if not ex.solution:
        raise ValueError(
            f"example {ex.id}: no gold solution; CITER and Co-LLM teacher-force gold answers "
            "(give dicts with 'solution' or GSM8K rows with meta.solution)"
        )
    return list(pair.tokenizer.encode(ex.solution, add_special_tokens=False))


def reference_texts(
    pair: Pair,
    examples: list,
    reference: str,
    *,
    max_new_tokens: int,
    concurrency: int = 16,
    cache=None,
    progress: bool = False,
) -> list[list[int]]:
    """The token ids CITER and Co-LLM teacher-force per example: the gold solution
    (``reference="gold"``) or the large model's greedy response of at most ``max_new_tokens``
    tokens (``"large"``, `reference_responses`, cached in ``cache``).

    Raises:
        ValueError: an unknown ``reference``, or (gold) an example without a solution.
    """
    if reference == "gold":
        return [gold_ids(pair, ex) for ex in examples]
    if reference == "large":
        return reference_responses(
            pair,
            [pair.encode(ex.prompt) for ex in examples],
            max_new_tokens=max_new_tokens,
            concurrency=concurrency,
            cache=cache,
            progress=progress,
        )
    raise ValueError(f"reference must be 'gold' or 'large', got {reference!r}")


@torch.inference_mode()
def forward_features(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced forward of ``ids`` -> ``(hidden [T, H], logits [T, V])``, float32.

    ``hidden[i]`` is the last-layer hidden state after the final norm at position i (what the
    engine gives policies as ``StepBatch.hidden`` for the token at i + 1) and ``logits[i]`` the
    next-token logits there.
    """
    x = torch.tensor([ids], device=model.device)
    h = model.get_decoder()(input_ids=x).last_hidden_state[0]
    return h.float(), model.get_output_embeddings()(h).float()


# -- training ------------------------------------------------------------------------------------


def teacher_forced(
    pair, examples: list, refs: list[list[int]], max_gold_tokens: int, desc: str, progress: bool = False
):
    """Teacher forcing of both models on each example's reference continuation: yields, per
    example with a non-empty reference, ``(index, prompt ids, reference ids g, small hidden
    [len(g), H], small logits [len(g), V], large logits [len(g), V])``; row t is the position
    that predicts ``g[t]`` (references cut to ``max_gold_tokens``)."""
    from tqdm.auto import tqdm

    for i, ex in enumerate(tqdm(examples, desc=desc, disable=not progress)):
        p, g = pair.encode(ex.prompt), refs[i][:max_gold_tokens]
        if not g:
            continue
        hs, ls = forward_features(pair.small, p + g)
        _, ll = forward_features(pair.large, p + g)
        rows = slice(len(p) - 1, len(p) - 1 + len(g))
        yield i, p, g, hs[rows], ls[rows], ll[rows]


def fit_bce(
    net: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    y: torch.Tensor,
    *,
    val: tuple | None = None,
    epochs: int = 30,
    lr: float = 1e-3,
    weight_decay: float = 5e-4,
    batch_size: int = 256,
    pos_weight: float | None = None,
    patience: int = 10,
    seed: int = 0,
    loss_fn: Callable | None = None,
    progress: bool = False,
    desc: str = "train",
) -> dict:
    """Train ``net`` (``net(*inputs) -> logits [N]``) with AdamW on BCE-with-logits (or
    ``loss_fn(logits, batch_inputs, y) -> scalar``); keeps the weights of the best validation
    loss (early stopping after ``patience`` epochs without improvement). Batch order and dropout
    are drawn from ``seed`` (the caller's global random state is left as it was).

    Args:
        inputs: tensors with N rows each; y: labels [N] in {0, 1} (float).
        val: ``(inputs, y)`` for early stopping, or None (then the training loss is used).
        pos_weight: weight of the positive class in BCE (None = 1).

    Returns:
        ``{"train_loss": [per epoch], "val_loss": [per epoch], "best_epoch": int,
        "initial_train_loss": float}`` (losses are means over rows).
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    pw = None if pos_weight is None else torch.tensor(float(pos_weight))

    def loss_of(out, xs, t):
        if loss_fn is not None:
            return loss_fn(out, xs, t)
        return nn.functional.binary_cross_entropy_with_logits(out, t, pos_weight=pw)

    def evaluate(xs, t):
        net.eval()
        with torch.no_grad():
            return float(loss_of(net(*xs), xs, t))

    n = len(y)
    hist = {"train_loss": [], "val_loss": [], "best_epoch": 0, "initial_train_loss": evaluate(inputs, y)}
    best, best_state, bad = math.inf, {k: v.clone() for k, v in net.state_dict().items()}, 0
    from tqdm.auto import tqdm

    with torch.random.fork_rng(devices=[]):  # dropout draws from the seeded global generator
        torch.manual_seed(seed)
        for epoch in tqdm(range(epochs), desc=desc, disable=not progress):
            net.train()
            perm = torch.randperm(n, generator=g)
            for s in range(0, n, batch_size):
                b = perm[s : s + batch_size]
                if len(b) < 2 and n >= 2:  # BatchNorm needs 2 rows
                    continue
                xs = tuple(x[b] for x in inputs)
                loss = loss_of(net(*xs), xs, y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
            tr = evaluate(inputs, y)
            va = evaluate(*val) if val is not None and len(val[1]) else tr
            hist["train_loss"].append(tr)
            hist["val_loss"].append(va)
            if va < best - 1e-6:
                best, bad, hist["best_epoch"] = va, 0, epoch
                best_state = {k: v.clone() for k, v in net.state_dict().items()}
            else:
                bad += 1
                if bad >= patience:
                    break
    net.load_state_dict(best_state)
    net.eval()
    return hist


# -- metrics and thresholds ----------------------------------------------------------------------
def binary_metrics(pred: torch.Tensor, y: torch.Tensor) -> dict:
    """Precision, recall, positive rate and accuracy of boolean predictions against labels {0, 1}."""
    pred, y = pred.bool(), y.bool()
    tp, fp, fn = int((pred & y).sum()), int((pred & ~y).sum()), int((~pred & y).sum())
    n = max(1, len(y))
    return {
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
        "recall": tp / (tp + fn) if tp + fn else float("nan"),
        "positive_rate": float(pred.float().mean()) if len(y) else float("nan"),
        "accuracy": int((pred == y).sum()) / n,
        "n": len(y),
        "positives": int(y.sum()),
    }


def auc(score: torch.Tensor, y: torch.Tensor) -> float:
    """ROC AUC (probability a random positive scores above a random negative; ties count half);
    nan when one class is absent."""
    y = y.bool()
    pos, neg = score[y].double(), score[~y].double()
    if not len(pos) or not len(neg):
        return float("nan")
    gt = (pos[:, None] > neg[None, :]).double().mean()
    eq = (pos[:, None] == neg[None, :]).double().mean()
    return float(gt + 0.5 * eq)


def threshold_for_recall(score: torch.Tensor, y: torch.Tensor, target: float) -> float:
    """The largest tau with recall(score >= tau) >= target on labels y (R2R's ``min_recall``).
    Raises ValueError when y has no positive (no recall to reach)."""
    pos = torch.sort(score[y.bool()].double(), descending=True).values
    if not len(pos):
        raise ValueError(
            "threshold_for_recall: no positive label in the validation data; train on more "
            "prompts or lower val_fraction"
        )
    k = max(1, math.ceil(target * len(pos) - 1e-9))
    return float(pos[k - 1])


def threshold_below_for_recall(score: torch.Tensor, y: torch.Tensor, target: float) -> float:
    """The smallest tau with recall(score < tau) >= target on labels y (CITER's rule ``c < tau``):
    the next float32 above the k-th smallest positive score. ValueError without positives."""
    pos = torch.sort(score[y.bool()].float()).values
    if not len(pos):
        raise ValueError(
            "threshold_below_for_recall: no positive label in the validation data; train on more "
            "prompts or lower val_fraction"
        )
    k = max(1, math.ceil(target * len(pos) - 1e-9))
    return float(torch.nextafter(pos[k - 1], torch.tensor(math.inf)))


def threshold_youden(score: torch.Tensor, y: torch.Tensor) -> float:
    """eta maximising Youden's J = TPR - FPR for the rule ``score > eta`` (Co-LLM's validation
    rule); candidates are midpoints between sorted distinct scores and the ends."""
    s = torch.unique(score.double())
    cands = torch.cat([s[:1] - 1e-6, (s[1:] + s[:-1]) / 2, s[-1:]])
    y = y.bool()
    npos, nneg = max(1, int(y.sum())), max(1, int((~y).sum()))
    best, eta = -math.inf, float(cands[0])
    for c in cands.tolist():
        pred = score.double() > c
        j = int((pred & y).sum()) / npos - int((pred & ~y).sum()) / nneg
        if j > best + 1e-12:
            best, eta = j, c
    return eta


def threshold_for_rate(score: torch.Tensor, rate: float, *, above: bool = True) -> float:
    """A threshold routing about ``rate`` of the rows: ``score >= tau`` when ``above`` (R2R), else
    ``score < tau`` (CITER, query-level), a quantile of ``score``."""
    if not 0 <= rate <= 1:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    s = torch.sort(score.double()).values
    if above:
        k = min(len(s) - 1, max(0, math.ceil((1 - rate) * len(s))))
        return float(s[k]) if rate > 0 else float(s[-1]) + 1e-6
    k = min(len(s) - 1, max(0, math.floor(rate * len(s))))
    return float(s[k]) if rate < 1 else float(s[-1]) + 1e-6


# -- the run record -------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What a training run produced.

    Attributes:
        kind: ``"r2r"``, ``"citer"``, ``"co_llm"`` or ``"query"``.
        head_path: the head file (`tokenrouter_sdk.policies.heads` format) the policy reads.
        meta_path: the JSON record next to it (same content as the head's ``meta``).
        threshold: the chosen threshold (R2R tau, CITER tau, Co-LLM eta, query threshold).
        metrics: validation metrics (precision, recall, AUC, ...), plain floats.
        meta: data ids and source, model pair, hyperparameters, label counts, metrics, timings.
        history: training losses per epoch.
        data: the labelled training and validation rows, ``(train, val)`` (kept in memory only).
    """

    kind: str
    head_path: Path
    meta_path: Path
    threshold: float
    metrics: dict
    meta: dict
    history: dict = field(default_factory=dict)
    _embedding: object = field(default=None, repr=False)
    data: object = field(default=None, repr=False)

    def policy(self, **kw):
        """The trained policy with the chosen threshold (override with ``tau=``/``eta=``/
        ``threshold=``); R2R uses the small model's embedding table kept from training."""
        from tokenrouter_sdk import policies as P

        if self.kind == "r2r":
            return P.R2R(str(self.head_path), **({"embedding": self._embedding, "tau": self.threshold} | kw))
        if self.kind == "citer":
            return P.CITER(str(self.head_path), **({"tau": self.threshold} | kw))
        if self.kind == "co_llm":
            return P.CoLLM(str(self.head_path), **({"eta": self.threshold} | kw))
        return P.QueryRouter(str(self.head_path), **({"threshold": self.threshold} | kw))


def plain(x):
    """``x`` with tensors/paths/numbers made JSON- and weights_only-safe (nan -> None)."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, torch.Tensor):
        return plain(x.tolist())
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, str):
        return str(x)  # also str subclasses such as torch.__version__, which weights_only refuses
    return str(x)


def base_meta(kind: str, pair: Pair, train, val, data_source, hyper: dict) -> dict:
    """The common part of every run's ``meta``."""
    import transformers

    from tokenrouter_sdk.train.data import HELDOUT

    return {
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "data": {
            "source": str(data_source) if data_source is not None else "given prompts",
            "train_ids": [e.id for e in train],
            "val_ids": [e.id for e in val],
            "heldout": f"GSM8K test ids gsm8k-test-0000..{HELDOUT - 1:04d} are reserved for evaluation "
            "and excluded from training by load_examples",
        },
        "models": pair.describe(),
        "hyperparameters": hyper,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def write_run(kind: str, out, state_dict: dict, config: dict, meta: dict, name: str | None = None) -> tuple[Path, Path]:
    """Save the head with `save_head` as ``<out>/<name>.pt`` and ``meta`` as ``<out>/<name>.json``
    (name defaults to ``<kind>_head``); returns both paths."""
    from tokenrouter_sdk.policies.heads import save_head

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = name or f"{kind}_head"
    head, js = out / f"{stem}.pt", out / f"{stem}.json"
    meta = plain(meta)
    save_head(head, kind, state_dict, plain(config), meta)
    js.write_text(json.dumps(meta, indent=1))
    return head, js
