"""R2R: Roads to Rome, token-level routing of divergent tokens (arXiv 2505.21600, NeurIPS'25;
official code thu-nics/R2R, ``r2r/models/router.py``
``HiddenStatesTokenLMHeadLogitsClassifier``, ``r2r/utils/switching.py``, ``r2r/utils/metrics.py``).

Signal, on each step of the small model S for its sampled token t:
    h    = S's last-layer hidden state of the position that produced t (after the final norm), [H]
    e    = S's input embedding of t, [E] (a frozen copy of S's table; the checkpoint strips it)
    z    = S's top-k raw next-token logit values, sorted descending, k = 100
    p    = sigmoid(f([h, e, W_z z + b_z]))    W_z: Linear(k -> H)
    f    = Linear(2H + E -> d) -> Linear(d -> d) -> n residual blocks
           x + Linear(4d -> d)(Dropout(GELU(Linear(d -> 4d)(LayerNorm(x))))) -> LayerNorm -> Linear(d -> 1)
(d = 1024, n = 6, H = E = 1536 for the R1-1.5B router; all sizes are read from the checkpoint.)
Rule: p >= tau (ties route) -> S's token is discarded and the large model L writes exactly one
token for that position, with the request's own sampling parameters; S resumes. The router never
runs on L's output. tau is ``common_args.threshold`` stored in the checkpoint (picked for recall
>= 0.95 on divergent tokens) unless given; R2R's eval configs override it (AIME 0.406, GPQA 0.42,
LiveCodeBench 0.1387).

Checkpoint: ``default_router.pt`` of HF ``nics-efc/R2R_router_collections``: a dict with
``model_type``, ``init_args``, ``common_args`` (threshold, input_type), ``model_specific_args`` and
``state_dict`` without ``token_embeddings.weight``. Load it from a local path; pass the small
model (or its input embedding table) as ``embedding``. Routers with a position embedding
(``use_position_embedding``, off in every shipped config) are refused.

Packaged head: without ``head``, the router trained for `Router.default`'s pair is loaded
(``tokenrouter_sdk/assets/smollm2_r2r_head.pt``, float16, made by ``tokenrouter train r2r``; its
record, with the measured agreement, is the ``.json`` beside it). Its stored tau sends about 0.7 of
the committed tokens to the large model (calibrated in the engine, greedy, GSM8K prompts; the
pair's small model writes a different token from the large one at about half the positions, and
at a quarter large fraction no head beats random routing on this pair, docs/train.md), and it
reads SmolLM2-135M-Instruct's token table from the model cache (``embedding_source`` in its
config) in whichever process routes, when no ``embedding`` is given.

Training-free variants of the same code (``switching.py``), same commit rule and span:
- `R2REntropy`: full-vocabulary entropy of S's next-token distribution in nats; L iff H >= 0.45.
- `R2RAleatoric` (``immediate`` strategy): LogU aleatoric uncertainty of the top-10 raw logits
  x_1..x_k taken as Dirichlet evidence, S = sum_i x_i:
      AU = -sum_i (x_i / S) (digamma(x_i + 1) - digamma(S + 1));   L iff AU >= 2.275.
  The formula is meant for positive logits; for others it may be NaN, which routes to L, as in
  the code (``quick if AU < threshold else reference``). Entropy behaves the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenrouter_sdk.policy import Needs, StepBatch

from .heads import DeferOneToken, HeadRecord, check_hidden, head_label, on_device, resolve_head

MODEL_TYPE = "HiddenStatesTokenLMHeadLogitsClassifier"
INPUT_TYPE = ["hidden_states", "token", "logits"]
EMBEDDING_SOURCE = "smollm2-135m-instruct"  # the smollm2 pair's token table, in the model cache
# per named pair, the cache folder of the small model whose token table its packaged router reads
EMBEDDING_SOURCES = {"smollm2": EMBEDDING_SOURCE, "qwen2.5-coder": "qwen2.5-coder-0.5b-instruct"}
_BUILDERS = {
    "smollm2-135m-instruct": "tokenrouter_sdk.models.smollm2_folder()",
    "qwen2.5-coder-0.5b-instruct": "Router.default(pair='qwen2.5-coder')",
}


def source_embedding(source: str) -> torch.Tensor:
    """The input embedding table [V, E] (float32) a head names in ``config["embedding_source"]``,
    read from the model cache (``<cache>/<source>/model.safetensors``; the sources are the small
    models of the named pairs, `EMBEDDING_SOURCES`).

    Raises:
        ValueError: an unknown source.
        FileNotFoundError: the cached model is absent (names how to build it).
    """
    if source not in _BUILDERS:
        raise ValueError(
            f"R2R: unknown embedding_source {source!r} in the head's config (known: "
            f"{', '.join(sorted(_BUILDERS))}); pass embedding=<the small model>"
        )
    from safetensors import safe_open

    from tokenrouter_sdk.models import cache_dir

    path = cache_dir() / source / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(
            f"R2R: the head reads the token embeddings of {source} from {path}, which is "
            f"missing: build it once with {_BUILDERS[source]}, or pass embedding=<the small model>"
        )
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


class _Block(nn.Module):
    """R2R ``ClassifierBlock``: pre-LayerNorm MLP with a residual (projected when sizes differ)."""

    def __init__(self, d_in: int, d_hid: int, d_out: int):
        super().__init__()
        self.layer_norm = nn.LayerNorm(d_in)
        self.mlp = nn.Sequential(
            nn.Linear(d_in, d_hid), nn.GELU(), nn.Dropout(0.1), nn.Linear(d_hid, d_out), nn.Dropout(0.1)
        )
        self.dim_change = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()

    def forward(self, x):
        return self.dim_change(x) + self.mlp(self.layer_norm(x))


class _Backbone(nn.Module):
    """R2R ``ClassifierBackbone`` (no position embedding)."""

    def __init__(self, blocks: list[tuple[int, int, int]], n_out: int):
        super().__init__()
        d0, d_last = blocks[0][0], blocks[-1][2]
        self.input_projection = nn.Linear(d0, d0)
        self.blocks = nn.ModuleList(_Block(*b) for b in blocks)
        self.output_layer = nn.Sequential(nn.LayerNorm(d_last), nn.Linear(d_last, n_out))

    def forward(self, x):
        x = self.input_projection(x)
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x)


class RouterNet(nn.Module):
    """``HiddenStatesTokenLMHeadLogitsClassifier`` without its token table, same parameter names.
    forward(h [B, H], e [B, E], z [B, k]) -> logits [B, n_out]."""

    def __init__(
        self,
        hidden_size: int,
        embed_size: int,
        logits_size: int,
        blocks: list[tuple[int, int, int]],
        n_out: int = 1,
        normalize_input: bool = False,
    ):
        super().__init__()
        self.hidden_size, self.embed_size, self.logits_size = hidden_size, embed_size, logits_size
        self.normalize_input = normalize_input
        if normalize_input:
            self.layer_norm_hidden_states = nn.LayerNorm(hidden_size)
            self.layer_norm_token = nn.LayerNorm(embed_size)
        self.logits_projection = nn.Linear(logits_size, hidden_size)
        self.combined_projection = nn.Linear(2 * hidden_size + embed_size, blocks[0][0])
        self.backbone = _Backbone(blocks, n_out)

    @classmethod
    def from_state_dict(cls, sd: dict) -> "RouterNet":
        """Build with the sizes the state dict's shapes give, then load it."""
        if any("position_embedding" in k for k in sd):
            raise ValueError("R2R: routers with a position embedding (use_position_embedding=True) are not supported")
        try:
            H, k = sd["logits_projection.weight"].shape
            d0, c = sd["combined_projection.weight"].shape
            blocks, i = [], 0
            while f"backbone.blocks.{i}.layer_norm.weight" in sd:
                p = f"backbone.blocks.{i}."
                blocks.append(
                    (
                        sd[p + "layer_norm.weight"].shape[0],
                        sd[p + "mlp.0.weight"].shape[0],
                        sd[p + "mlp.3.weight"].shape[0],
                    )
                )
                i += 1
            n_out = sd["backbone.output_layer.1.weight"].shape[0]
            net = cls(H, c - 2 * H, k, blocks, n_out, "layer_norm_hidden_states.weight" in sd)
            net.load_state_dict(sd)
        except (KeyError, IndexError, RuntimeError) as e:
            raise ValueError(f"R2R: not a {MODEL_TYPE} state dict ({type(e).__name__}: {e})") from e
        return net.float().eval().requires_grad_(False)

    def forward(self, h, e, z):
        if self.normalize_input:
            h, e, z = self.layer_norm_hidden_states(h), self.layer_norm_token(e), torch.softmax(z, -1)
        return self.backbone.forward(self.combined_projection(torch.cat([h, e, self.logits_projection(z)], -1)))


def _published(obj):
    """R2R's saved layout (``save_model`` in r2r/models/router.py) -> (state_dict, config, meta)."""
    if not (isinstance(obj, dict) and "state_dict" in obj and "model_type" in obj):
        raise ValueError(
            "not an R2R router: expected a tokenrouter head file of kind 'r2r' or R2R's "
            "default_router.pt layout (model_type, init_args, common_args, state_dict)"
        )
    if obj["model_type"] != MODEL_TYPE:
        raise ValueError(f"R2R: router model_type {obj['model_type']!r} is not supported, only {MODEL_TYPE!r}")
    common, init = obj.get("common_args") or {}, obj.get("init_args") or {}
    if common.get("input_type") not in (None, INPUT_TYPE):
        raise ValueError(f"R2R: router input_type {common['input_type']} is not supported, only {INPUT_TYPE}")
    meta = {"source": "R2R default_router.pt", "pretrained_model_name": init.get("pretrained_model_name")}
    return obj["state_dict"], {"threshold": common.get("threshold")}, meta


class R2R(HeadRecord, DeferOneToken):
    """Args:
    head: the router: a path to ``default_router.pt`` (or a tokenrouter head file of kind
        ``"r2r"``), that checkpoint's dict, or a `RouterNet`; None (default) = the router
        packaged for `Router.default`'s pair (hidden size 576; another pair fails at its first
        step with an error naming the fix: train one with ``tokenrouter train r2r``). A
        missing file raises `HeadMissingError`, which says how to get one.
    embedding: the small model's input embedding table [V, E]: the model itself, its
        ``nn.Embedding``, or the weight tensor. Required unless the checkpoint holds
        ``token_embeddings.weight`` (R2R's ``*_all.pt``) or names an ``embedding_source``
        (the packaged router: SmolLM2-135M-Instruct's table, read from the model cache at
        the first step, in the process that routes).
    tau: route when p >= tau; default: the threshold stored in the checkpoint (the packaged
        router's sends about 0.7 of the tokens to the large model).
    small, large: model names (default: first and last model).
    pair: with ``head=None``, the named pair whose packaged router to load (``"smollm2"``,
        the default, or ``"qwen2.5-coder"``: it reads Qwen2.5-Coder-0.5B's token table).
    """

    one_vocabulary = True  # the router learned where the small model's tokens diverge from the large one's

    def __init__(
        self,
        head=None,
        embedding=None,
        tau: float | None = None,
        small: str | None = None,
        large: str | None = None,
        pair: str | None = None,
    ):
        self.head = head_label(head, "r2r", pair)
        sd, cfg, self._head_meta = resolve_head(head, "r2r", _published, pair)
        sd = dict(sd)
        table = sd.pop("token_embeddings.weight", None)
        self._net = RouterNet.from_state_dict(sd)
        emb = table if embedding is None else embedding
        self._emb_source = cfg.get("embedding_source") if emb is None else None
        if emb is None and self._emb_source is None:
            raise ValueError(
                "R2R: the checkpoint holds no token embedding table (R2R strips it); pass the small "
                "model's: R2R(head, embedding=small_model)"
            )
        self._emb = None
        if emb is not None:
            if hasattr(emb, "get_input_embeddings"):
                emb = emb.get_input_embeddings()
            self._set_table((emb.weight if isinstance(emb, nn.Embedding) else emb).detach())
        tau = cfg.get("threshold") if tau is None else tau
        if tau is None:
            raise ValueError(
                "R2R: the checkpoint stores no threshold (common_args.threshold); pass tau=..., "
                "e.g. 0.406 (R2R's AIME eval config)"
            )
        self.tau, self.small, self.large = float(tau), small, large
        self.hidden_size, self.logits_size = self._net.hidden_size, self._net.logits_size
        self.needs = Needs(hidden=True, topk=self.logits_size)

    @classmethod
    def random_head(
        cls,
        hidden_size: int,
        seed: int = 0,
        *,
        logits_size: int = 100,
        hidden_dims: tuple[int, ...] = (64, 64),
        expansion_factor: int = 4,
        threshold: float | None = 0.5,
    ) -> dict:
        """A router with random weights in R2R's checkpoint layout (``torch.save`` it to get a
        ``default_router.pt`` look-alike), for tests; E = H as in R2R."""
        dims = list(hidden_dims) + [hidden_dims[-1]]
        blocks = [(dims[i], dims[i] * expansion_factor, dims[i + 1]) for i in range(len(hidden_dims))]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = RouterNet(hidden_size, hidden_size, logits_size, blocks)
        init = {
            "hidden_states_size": hidden_size,
            "logits_size": logits_size,
            "hidden_dims": list(hidden_dims),
            "expansion_factor": expansion_factor,
            "dropout_rate": 0.1,
            "use_position_embedding": False,
            "freeze_lm_head": True,
            "normalize_input": False,
            "pretrained_model_name": None,
        }
        return {
            "model_type": MODEL_TYPE,
            "init_args": init,
            "model_specific_args": {},
            "common_args": {"threshold": threshold, "input_type": list(INPUT_TYPE)},
            "state_dict": net.state_dict(),
        }

    def _set_table(self, table: torch.Tensor) -> None:
        if table.shape[-1] != self._net.embed_size:
            raise ValueError(
                f"R2R: the router expects token embeddings of size {self._net.embed_size} but the "
                f"given table has size {table.shape[-1]}: the router belongs to another model"
            )
        self._emb = table

    def __getstate__(self):
        state = self.__dict__.copy()
        if state.get("_emb_source") is not None:
            state["_emb"] = None  # re-read from the model cache where it is used
        return state

    def prob(self, batch: StepBatch) -> torch.Tensor:
        """p (probability that the small token is divergent) per request, shape [B] (float32)."""
        check_hidden("r2r", self.hidden_size, batch.hidden.shape[-1])
        if self._emb is None:
            self._set_table(source_embedding(self._emb_source))
        net, dev = on_device(self._net, batch.hidden), batch.hidden.device
        e = self._emb[batch.tokens.to(self._emb.device)].to(dev, torch.float32)
        z = batch.topk(self.logits_size)[0].to(dev, torch.float32)
        out = net(batch.hidden.float(), e, z)
        return torch.sigmoid(out[:, 0]) if out.shape[-1] == 1 else torch.softmax(out, -1)[:, 2]

    def defer(self, batch: StepBatch) -> torch.Tensor:
        return self.prob(batch) >= self.tau


class R2REntropy(DeferOneToken):
    """R2R's ``entropy`` strategy: route when the small model's entropy (nats) >= ``threshold``."""

    needs = Needs(entropy=True)

    def __init__(self, threshold: float = 0.45, small: str | None = None, large: str | None = None):
        self.threshold, self.small, self.large = threshold, small, large

    def defer(self, batch: StepBatch) -> torch.Tensor:
        return ~(batch.entropy < self.threshold)


def aleatoric_uncertainty(logits: torch.Tensor, k: int = 10) -> torch.Tensor:
    """R2R ``compute_logu`` aleatoric part on the top-k raw logits, [B, V] (or the top-k values,
    [B, k]) -> [B] (float32)."""
    x = torch.topk(logits, k, dim=-1).values.float()
    S = x.sum(-1, keepdim=True)
    return -((x / S) * (torch.digamma(x + 1) - torch.digamma(S + 1))).sum(-1)


class R2RAleatoric(DeferOneToken):
    """R2R's ``immediate`` strategy: route when the top-``k`` LogU aleatoric uncertainty >= ``threshold``."""

    def __init__(self, threshold: float = 2.275, k: int = 10, small: str | None = None, large: str | None = None):
        self.threshold, self.k, self.small, self.large = threshold, k, small, large
        self.needs = Needs(topk=k)

    def defer(self, batch: StepBatch) -> torch.Tensor:
        return ~(aleatoric_uncertainty(batch.topk(self.k)[0], self.k) < self.threshold)
