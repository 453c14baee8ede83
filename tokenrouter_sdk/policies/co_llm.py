"""Co-LLM: Learning to Decode Collaboratively with Multiple Language Models (arXiv 2403.03870,
ACL'24; official code clinicalml/co-llm,
``collm/generate.py generate_response``, ``collm/inference/api_server_deferral.py``).

Signal: a deferral head g on the small ("base") model's last-layer hidden state h_t. In Co-LLM g
is one extra row of the base model's vocabulary projection (``<|defer|>``), split off before
sampling; here it is a separate vector [H] plus a bias b:

    pi_t = sigmoid(g . h_t + b)

Rule (``deferral_strategy="defer"``): pi_t > eta_t -> the base token is discarded and the large
("assistant") model writes exactly one token for that position; control returns to the base.
``eta_t`` follows the optional warm-up schedule of the code (``create_deferral_threshold_schedule``:
from 1.0, i.e. never defer, to eta over ``warmup_steps`` output tokens; default constant).

The assistant writes its one token greedily (``Handoff(greedy=True)``), whatever the request's
sampling.

``compose=True`` (``deferral_strategy="compose"``): at a deferral position the token written is
argmax_x [(1 - pi_t) p_base(x) + pi_t p_asst(x)], exactly: the base token is discarded and the
base model's logits travel with the handoff (``Needs(handoff_logits=True)``); the assistant's
route reads them (``step.peer_logits``), mixes the two softmaxes with the pi_t stored at deferral
(``state["co_llm_pi"]``), writes the argmax with ``step.set_token`` (the base's token, the
assistant's or any third token) and hands back keeping it. One assistant forward per deferral.

Defaults: eta = 0.5 (``generate_deferral(deferral_threshold=0.5)``); the paper picks eta per task
on validation data (Youden's J / deferral-rate sweep), so pass yours.
Deviations: Co-LLM decodes the base model greedily too; here the base samples with the request's
own parameters (identical under greedy decoding, the default). ``tokens_per_call`` > 1 (the base
drafts k tokens, truncated at the first deferral) is not implemented: the scripts use 1.
Weights: Co-LLM publishes none, and it fine-tunes the whole base model jointly with g; a head
trained on a frozen small model is an approximation. ``head`` takes a tokenrouter head file (kind
``"co_llm"``), a `DeferralHead`, or a state dict ``{"g": [H], "b": []}``; the deferral row of a
fine-tuned Co-LLM checkpoint is ``lm_head.weight[-1]`` (pass ``{"g": row, "b": torch.tensor(0.)}``).
Without one, the head packaged for ``pair`` is loaded
(``tokenrouter_sdk/assets/<pair>_co_llm_head.pt``, trained by ``tokenrouter train co_llm``; its
record is the ``.json`` beside it) with its stored eta, calibrated in the engine (greedy, GSM8K
train prompts) so that a share of the committed tokens come from the large model: about 0.7 for
``smollm2`` (measured on the 128 held-out GSM8K questions: the record's ``heldout`` section; on
that pair no head beats random routing at a quarter large fraction, docs/train.md), about 0.3
for ``qwen2.5-coder`` (trained on gold GSM8K train solutions; docs/train.md). A smaller ``eta``
routes more.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenrouter_sdk.policy import Handoff, Needs, Step, StepBatch

from .heads import DeferOneToken, HeadRecord, check_hidden, head_label, on_device, resolve_head

WARMUPS = ("constant", "linear", "cosine", "exponential")


class DeferralHead(nn.Module):
    """g and b: h [B, H] -> pi [B] = sigmoid(h . g + b)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.g = nn.Parameter(torch.zeros(hidden_size))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(h @ self.g + self.b)


def warmup_eta(t: int, eta: float, schedule: str, steps: int) -> float:
    """eta_t of Co-LLM's threshold schedule: from 1.0 at t=0 to ``eta`` at t >= ``steps``."""
    if schedule == "constant" or t >= steps:
        return eta
    if schedule == "linear":
        return 1.0 + (eta - 1.0) * t / steps
    if schedule == "cosine":
        return eta + (1.0 - eta) / 2 * (math.cos(math.pi * t / steps) + 1)
    return eta ** (t / steps)  # exponential: 1.0 * (eta / 1.0) ** (t / steps)


class CoLLM(HeadRecord, DeferOneToken):
    """Args:
    head: the deferral head: a path, a `DeferralHead` or ``{"g": [H], "b": []}``; None
        (default) = the head packaged for ``pair`` (hidden size 576 for ``smollm2``, 896 for
        ``qwen2.5-coder``; another pair fails at its first step with an error naming the fix:
        train one with ``tokenrouter train co_llm``). A missing file raises `HeadMissingError`.
    eta: defer when pi > eta. None (default): the threshold stored in the head file (the
        packaged heads' send about 0.7 (smollm2) and 0.3 (qwen2.5-coder) of the tokens to the
        large model), else 0.5.
    compose: write the argmax of the mixed distributions at deferral positions (see the
        module docstring).
    warmup: threshold schedule, one of ``constant`` (default), ``linear``, ``cosine``,
        ``exponential``, from 1.0 to eta over ``warmup_steps`` (default 15) output tokens.
    small, large: model names (default: first and last model).
    pair: with ``head=None``, the named pair whose packaged head to load (``"smollm2"``,
        the default, or ``"qwen2.5-coder"``).
    """

    one_vocabulary = True  # the head learned deferral over one vocabulary; compose mixes both models' logits

    def __init__(
        self,
        head=None,
        eta: float | None = None,
        compose: bool = False,
        warmup: str = "constant",
        warmup_steps: int = 15,
        small: str | None = None,
        large: str | None = None,
        pair: str | None = None,
    ):
        if warmup not in WARMUPS:
            raise ValueError(f"CoLLM: warmup must be one of {WARMUPS}, got {warmup!r}")
        self.head = head_label(head, "co_llm", pair)
        sd, cfg, self._head_meta = resolve_head(head, "co_llm", pair=pair)
        if eta is None:
            eta = cfg.get("threshold", 0.5)
        if set(sd) != {"g", "b"}:
            raise ValueError(f"CoLLM: a deferral head has tensors 'g' [H] and 'b' [], got {sorted(sd)}")
        self.hidden_size = int(sd["g"].shape[-1])
        self._net = DeferralHead(self.hidden_size)
        self._net.load_state_dict({"g": sd["g"].reshape(-1), "b": sd["b"].reshape(())})
        self._net.float().eval().requires_grad_(False)
        self.eta, self.compose, self.warmup, self.warmup_steps = eta, compose, warmup, warmup_steps
        self.small, self.large = small, large
        self.needs = Needs(hidden=True, logits=compose, handoff_logits=compose)

    @classmethod
    def random_head(cls, hidden_size: int, seed: int = 0, bias: float = 0.0) -> DeferralHead:
        """A head with g ~ N(0, 1/H) and the given bias (for tests; it routes arbitrarily)."""
        head = DeferralHead(hidden_size)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.g.copy_(torch.randn(hidden_size, generator=g) / math.sqrt(hidden_size))
            head.b.fill_(bias)
        return head

    def deferral_prob(self, batch: StepBatch) -> torch.Tensor:
        """pi for each request of the batch, shape [B] (float32)."""
        check_hidden("co_llm", self.hidden_size, batch.hidden.shape[-1])
        return on_device(self._net, batch.hidden)(batch.hidden.float())

    def defer(self, batch: StepBatch) -> torch.Tensor:
        pi = self.deferral_prob(batch)
        eta = torch.tensor(
            [warmup_eta(r.n_generated, self.eta, self.warmup, self.warmup_steps) for r in batch.requests],
            device=pi.device,
        )
        d = pi > eta
        if self.compose:
            for i, r in enumerate(batch.requests):
                if d[i]:
                    r.state["co_llm_pi"] = float(pi[i])
        return d

    def route_batch(self, batch: StepBatch) -> list[str]:
        small = self.small or batch.models[0]
        if not self.compose or batch.model == small:
            return super().route_batch(batch)
        return [self._compose(batch[i], small) for i in range(len(batch))]

    @staticmethod
    def composed_token(pi: float, base_logits: torch.Tensor, asst_logits: torch.Tensor) -> int:
        """argmax_x [(1 - pi) p_base(x) + pi p_asst(x)] (softmaxes in float32); logits shape [V]."""
        p_base = torch.softmax(base_logits.float(), -1)
        p_asst = torch.softmax(asst_logits.float().to(p_base.device), -1)
        return int(((1 - pi) * p_base + pi * p_asst).argmax())

    def _compose(self, step: Step, small: str) -> str:
        pi = step.state.pop("co_llm_pi", None)
        base = step.peer_logits
        if pi is not None and base is not None:
            step.set_token(self.composed_token(pi, base, step.logits))
        return small

    def send(self, req, target) -> Handoff:
        if self.compose and req.owner == (self.small or req.models[0]):
            return Handoff(keep_sampled=False, greedy=True)  # the assistant's route composes
        if self.compose:
            return Handoff(keep_sampled=True)  # back to the base, keeping the composed token
        return Handoff(keep_sampled=False, span=1, greedy=True)
