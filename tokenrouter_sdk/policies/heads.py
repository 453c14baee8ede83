"""Learned routing heads: one small file format, the error raised when a head is missing, and
the plumbing shared by the one-token deferral policies (CITER, Co-LLM, R2R).

File format: ``torch.save`` of a plain dict, read back with ``torch.load(weights_only=True)``::

    {"format": "tokenrouter-head", "version": 1, "kind": "citer" | "co_llm" | "r2r",
     "state_dict": {name: tensor}, "config": {...}, "meta": {...}}

``config`` and ``meta`` hold only plain Python values (str, int, float, bool, None, lists, dicts)
so that the weights-only loader accepts them. Foreign formats (the CITER trainer's raw state
dict, R2R's ``default_router.pt``) are read by the policy that knows them.

Packaged heads: the package ships one head per kind for each named pair (`tokenrouter_sdk.pairs`):
``tokenrouter_sdk/assets/<pair>_<kind>_head.pt`` (float16) with its record
``<pair>_<kind>_head.json`` (command, data ids, seed, library versions, training and held-out
metrics), for ``smollm2`` (SmolLM2-135M-Instruct and its self-draft, hidden size 576) and
``qwen2.5-coder`` (Qwen2.5-Coder 0.5B and 1.5B, hidden size 896). A learned policy built without
a head (``head=None``) loads its ``pair``'s (default ``smollm2``), and its threshold defaults to
the one stored there. ``tokenrouter train <kind> --pair <pair> --package`` rebuilds them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tokenrouter_sdk.policy import Handoff, Policy, Step, StepBatch

FORMAT, VERSION = "tokenrouter-head", 1

# kind -> (policy class, what the head is, where weights come from)
KINDS = {
    "citer": (
        "CITER",
        "a confidence head (MLP on the small model's last hidden state giving "
        "c = P(the small model's token is acceptable))",
        "aiming-lab/CITER publishes no router weights: train one per model pair",
    ),
    "co_llm": (
        "CoLLM",
        "a deferral head g (a vector [H] and a bias: pi = sigmoid(g . h + b) on the small model's last hidden state)",
        "clinicalml/co-llm publishes no weights: train one per model pair",
    ),
    "r2r": (
        "R2R",
        "a router network on [small last hidden state, sampled-token embedding, top-100 logits]",
        "published routers: HF nics-efc/R2R_router_collections, file default_router.pt (download it "
        "where you have hub access and pass its local path)",
    ),
    "query": (
        "QueryRouter",
        "a query-level head (logistic regression or MLP on the small model's last-layer "
        "hidden state at the last prompt token, giving p = P(the small model answers the prompt correctly))",
        "RouteLLM's published routers use other features (OpenAI embeddings, BERT): train one per small model",
    ),
}


PACKAGED_PAIR = "the packaged pairs (smollm2: hidden size 576; qwen2.5-coder: 896)"
HEAD_PAIRS = ("smollm2", "qwen2.5-coder")  # the pairs a packaged head may be built for (assets/<pair>_<kind>_head.pt)


def head_pair(pair: str | None) -> str:
    """The pair whose packaged heads ``pair`` names (None: ``smollm2``).

    Raises:
        ValueError: a pair without packaged heads (lists those with them).
    """
    name = "smollm2" if pair is None else str(pair)
    if name not in HEAD_PAIRS:
        raise ValueError(
            f"no packaged heads for pair {pair!r}; the pairs with packaged heads are "
            f"{', '.join(HEAD_PAIRS)} (or pass head=<a .pt file> trained with tokenrouter train)"
        )
    return name


def packaged_head_path(kind: str, pair: str | None = None) -> Path:
    """The packaged head of ``kind`` for a named pair (None: ``smollm2``):
    ``tokenrouter_sdk/assets/<pair>_<kind>_head.pt`` (it may be absent in a source tree where it
    was never built).

    Raises:
        ValueError: an unknown kind, or a pair without packaged heads.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    return Path(__file__).resolve().parent.parent / "assets" / f"{head_pair(pair)}_{kind}_head.pt"


class HeadMissingError(FileNotFoundError):
    """A learned policy's head file is absent: the path given, or (``head=None``) the packaged head."""

    def __init__(self, kind: str, path=None, packaged: bool = False, pair: str | None = None):
        cls, what, where = KINDS[kind]
        if packaged:
            pair = pair or "smollm2"
            given = (
                f"no head was given (head=None) and pair {pair!r} has no packaged {kind} head ({str(path)!r} "
                f"is missing; build it with `tokenrouter train {kind} --pair {pair} --package`, or route the "
                f"pair that has one: pair='smollm2')"
            )
        elif path is None:
            given = "no head was given"
        else:
            given = f"the head file {str(path)!r} does not exist"
        super().__init__(
            f"{cls} needs {what}, and {given}. {where}. Train one for your pair with "
            f"`tokenrouter_sdk.train.train_{kind}(router)` (CLI: `tokenrouter train {kind} --out heads`) and pass "
            f"head=<its .pt file>. For tests, a head with random weights can be made with `{cls}.random_head(...)`."
        )
        self.kind, self.path = kind, path


def save_head(path, kind: str, state_dict: dict, config: dict | None = None, meta: dict | None = None) -> None:
    """Write a head file (see the module docstring for the layout)."""
    if kind not in KINDS:
        raise ValueError(f"save_head: kind must be one of {sorted(KINDS)}, got {kind!r}")
    sd = {k: v.detach().cpu() for k, v in state_dict.items()}
    torch.save(
        {
            "format": FORMAT,
            "version": VERSION,
            "kind": kind,
            "state_dict": sd,
            "config": dict(config or {}),
            "meta": dict(meta or {}),
        },
        path,
    )


def _unpack(obj, kind: str, where: str, foreign) -> tuple[dict, dict, dict]:
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        if obj.get("kind") != kind:
            raise ValueError(
                f"{where}: holds a {obj.get('kind')!r} head, but a {kind!r} head was expected (by {KINDS[kind][0]})"
            )
        return obj["state_dict"], obj.get("config", {}), obj.get("meta", {})
    if foreign is not None:
        return foreign(obj)
    raise ValueError(f"{where}: not a tokenrouter head (no format={FORMAT!r} key); write one with save_head()")


def load_head(path, kind: str, foreign: Callable[[object], tuple] | None = None) -> tuple[dict, dict, dict]:
    """Read a head file -> ``(state_dict, config, meta)``. ``foreign(obj)`` converts other layouts.

    Raises:
        HeadMissingError: the file does not exist.
        ValueError: it holds another kind of head, or (without ``foreign``) is not a head file.
    """
    if not os.path.exists(path):
        raise HeadMissingError(kind, path)
    return _unpack(torch.load(path, map_location="cpu", weights_only=True), kind, str(path), foreign)


def head_label(head, kind: str, pair: str | None = None) -> str:
    """How a policy's repr names its head: the file path, the packaged head's path (of ``pair``)
    for None, or ``"<in memory>"`` for a module or state dict."""
    if head is None:
        return str(packaged_head_path(kind, pair))
    if isinstance(head, (str, os.PathLike)):
        return str(head)
    return "<in memory>"


class HeadRecord:
    """Mixin of the learned policies: ``head_meta``, the JSON record stored with the head (how it
    was made, its metrics; ``{}`` when it has none), kept out of the policy's repr. The token-level
    heads (CITER, Co-LLM, R2R) learned where one vocabulary's tokens of the two models agree:
    they set ``Policy.one_vocabulary``, so models with different tokenizers refuse them."""

    _head_meta: dict = {}

    @property
    def head_meta(self) -> dict:
        return self._head_meta


def resolve_head(
    head, kind: str, foreign: Callable[[object], tuple] | None = None, pair: str | None = None
) -> tuple[dict, dict, dict]:
    """``head`` as given to a policy (a path, an ``nn.Module`` or a state dict) -> ``(state_dict, config, meta)``;
    None = the packaged head of ``pair`` (`packaged_head_path`).

    Raises:
        HeadMissingError: the file (or, for None, the packaged head) does not exist.
        ValueError: ``pair`` with a head given (the head decides), or a pair without packaged heads.
    """
    if head is not None and pair is not None:
        raise ValueError(f"{KINDS[kind][0]}: give head=<a file> or pair=<a packaged pair>, not both")
    if head is None:
        path = packaged_head_path(kind, pair)
        if not path.exists():
            raise HeadMissingError(kind, path, packaged=True, pair=head_pair(pair))
        return load_head(path, kind, foreign)
    if isinstance(head, (str, os.PathLike)):
        return load_head(head, kind, foreign)
    if isinstance(head, nn.Module):
        return head.state_dict(), {}, {}
    if isinstance(head, dict):
        plain = head.get("format") != FORMAT and all(isinstance(v, torch.Tensor) for v in head.values())
        return (head, {}, {}) if plain else _unpack(head, kind, "head", foreign)
    raise TypeError(f"{KINDS[kind][0]}: head must be a path, an nn.Module or a state dict, got {type(head).__name__}")


def check_hidden(kind: str, head_size: int, model_size: int) -> None:
    """Raise a clear error when the head was made for another hidden size than the model's."""
    if head_size != model_size:
        raise ValueError(
            f"{KINDS[kind][0]} head expects hidden size {head_size} (from its weights) but the "
            f"small model's hidden states have size {model_size}: the head belongs to another model "
            f"(the packaged head is for {PACKAGED_PAIR}). Train one for this pair with "
            f"`tokenrouter_sdk.train.train_{kind}(router)` (CLI: `tokenrouter train {kind}`) and pass "
            f"head=<its .pt file>"
        )


class DeferOneToken(Policy):
    """Shared routing rule of CITER, Co-LLM and R2R: on each step of the small model, where
    ``defer(batch)`` is True the small model's token is discarded and the large model writes
    exactly one token for that position (``Handoff(keep_sampled=False, span=1)``); control then
    returns to the small model without calling ``route`` on the large one.

    Subclasses implement ``defer(batch) -> BoolTensor [B]`` (vectorised over the batch).
    ``small`` / ``large`` default to the first and last model.
    """

    small: str | None = None
    large: str | None = None

    def defer(self, batch: StepBatch) -> torch.Tensor:
        raise NotImplementedError

    def route_batch(self, batch: StepBatch) -> list[str]:
        small, large = self.small or batch.models[0], self.large or batch.models[-1]
        if batch.model != small:
            return [batch.model] * len(batch)
        with torch.no_grad():
            d = self.defer(batch).tolist()
        return [large if x else small for x in d]

    def route(self, step: Step) -> str:
        return self.route_batch(step.batch.select([step.i]))[0]

    def send(self, req, target):
        return Handoff(keep_sampled=False, span=1)


def on_device(net: nn.Module, x: torch.Tensor) -> nn.Module:
    """Move ``net`` (float32, eval mode) to ``x``'s device if it is elsewhere."""
    p = next(net.parameters(), None)
    if p is not None and p.device != x.device:
        net.to(x.device)
    return net
