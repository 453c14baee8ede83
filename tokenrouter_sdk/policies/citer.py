"""CITER: Collaborative Inference with Token-lEvel Routing (arXiv 2502.01976, COLM'25; official
code aiming-lab/CITER,
``src/models/conf_model.py`` and ``src/pipeline/token_route.py``).

Signal: a confidence head on the small model's last-layer hidden state h_t (after the final norm,
at the position that produced token t):

    c_t = sigmoid(Linear_{H->1}(MLP(h_t))),   MLP = Linear(H, 2H), BatchNorm1d, ReLU, Dropout(0.1),
                                                    Linear(2H, H), Dropout(0.1)    (torchvision MLP)

c_t estimates P(the small model's token is acceptable). Rule: c_t < tau -> the small token is
discarded, the large model writes exactly one token for that position, then the small model
resumes. The router never runs on the large model's output. Note the polarity: low confidence
routes (R2R routes on a high score).

Defaults: tau = 0.95, the default of the official inference script (``token_route.py --threshold``,
whose output file is named ``route_iter1_95``); the README's example command uses 0.9.
The large model writes its token greedily, as in CITER, whatever the request's sampling
(``Handoff(greedy=True)``); the small model samples with the request's parameters.
Weights: CITER publishes none. ``head`` takes a tokenrouter head file (kind ``"citer"``), the
state dict the CITER trainer saves (``mlp_training.py``: same parameter names), or a module.
Without one, the head packaged for ``pair`` is loaded
(``tokenrouter_sdk/assets/<pair>_citer_head.pt``, trained by ``tokenrouter train citer``; its record,
with the measured agreement, is the ``.json`` beside it) with its stored tau, calibrated in the
engine (greedy, GSM8K prompts) so that a share of the committed tokens come from the large model:
about 0.7 for ``smollm2`` (measured on the 128 held-out GSM8K questions: see the record's
``heldout`` section), about 0.3 for ``qwen2.5-coder`` (labels from gold GSM8K train solutions).
SmolLM2's self-draft writes a different token from its large model at about half the positions,
so a router that keeps the large model's answers has to write about that much with it; at a
quarter large fraction no head beats random routing on that pair (docs/train.md). A larger ``tau`` routes more.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenrouter_sdk.policy import Handoff, Needs, StepBatch

from .heads import DeferOneToken, HeadRecord, check_hidden, head_label, on_device, resolve_head


class ConfidenceHead(nn.Module):
    """CITER's ``ConfidenceModel`` with the same parameter names: h [B, H] -> c [B] in [0, 1]."""

    def __init__(self, hidden_size: int):
        super().__init__()
        H = hidden_size
        self.mlp = nn.Sequential(
            nn.Linear(H, 2 * H), nn.BatchNorm1d(2 * H), nn.ReLU(), nn.Dropout(0.1), nn.Linear(2 * H, H), nn.Dropout(0.1)
        )
        self.linear = nn.Linear(H, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(self.mlp(h))).squeeze(-1)


def _citer_state_dict(obj):
    if isinstance(obj, dict) and "linear.weight" in obj and "mlp.0.weight" in obj:
        return obj, {}, {"source": "CITER trainer state dict"}
    raise ValueError(
        "not a CITER head: expected a tokenrouter head file of kind 'citer' or a state dict "
        "with keys mlp.0.weight ... linear.weight (aiming-lab/CITER ConfidenceModel)"
    )


class CITER(HeadRecord, DeferOneToken):
    """Args:
    head: the confidence head: a path, a `ConfidenceHead` (or a module with its parameter
        names) or its state dict; None (default) = the head packaged for ``pair`` (hidden size
        576 for ``smollm2``, 896 for ``qwen2.5-coder``; another pair fails at its first step
        with an error naming the fix: train one with ``tokenrouter train citer``). A missing
        file raises `HeadMissingError`, which says how to get one.
    tau: route to the large model when c < tau. None (default): the threshold stored in the
        head file (the packaged heads' send about 0.7 (smollm2) and 0.3 (qwen2.5-coder) of the
        tokens to the large model), else 0.95 (CITER's default, see the module docstring).
    small, large: model names (default: first and last model).
    pair: with ``head=None``, the named pair whose packaged head to load (``"smollm2"``,
        the default, or ``"qwen2.5-coder"``).
    """

    needs = Needs(hidden=True)
    one_vocabulary = True  # the head learned when the small model's token agrees with the large one's

    def __init__(
        self,
        head=None,
        tau: float | None = None,
        small: str | None = None,
        large: str | None = None,
        pair: str | None = None,
    ):
        self.head = head_label(head, "citer", pair)
        sd, cfg, self._head_meta = resolve_head(head, "citer", _citer_state_dict, pair)
        if tau is None:
            tau = cfg.get("threshold", 0.95)
        if "linear.weight" not in sd:
            _citer_state_dict(sd)
        self.hidden_size = int(sd["linear.weight"].shape[1])
        self._net = ConfidenceHead(self.hidden_size)
        self._net.load_state_dict(sd)
        self._net.float().eval().requires_grad_(False)
        self.tau, self.small, self.large = tau, small, large

    @classmethod
    def random_head(cls, hidden_size: int, seed: int = 0) -> ConfidenceHead:
        """A head with random weights (for tests; it routes arbitrarily)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return ConfidenceHead(hidden_size).eval()

    def confidence(self, batch: StepBatch) -> torch.Tensor:
        """c for each request of the batch, shape [B] (float32)."""
        check_hidden("citer", self.hidden_size, batch.hidden.shape[-1])
        net = on_device(self._net, batch.hidden)
        return net(batch.hidden.float())

    def defer(self, batch: StepBatch) -> torch.Tensor:
        return self.confidence(batch) < self.tau

    def send(self, req, target) -> Handoff:
        """The small token is discarded; the large model writes one greedy token, then returns."""
        return Handoff(keep_sampled=False, span=1, greedy=True)
