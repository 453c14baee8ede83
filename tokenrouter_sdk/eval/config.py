"""What a sweep records about itself, so two result files can be compared: model pair, policy
class and parameters, engine settings, library versions; and the config hash that resume keys on."""

from __future__ import annotations

import hashlib
import json
import math
import platform


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        out = {k: _jsonable(x) for k, x in v.items()}
        return out if all(x is not None or v[k] is None for k, x in out.items()) else None
    return None


def describe_policy(policy) -> dict:
    """``{"class": "module.Qualname", "params": {...}}``: public attributes that are JSON values
    (tensors, heads and other objects are left out; their file path usually is an attribute)."""
    cls = type(policy)
    params = {k: _jsonable(v) for k, v in vars(policy).items() if not k.startswith("_")}
    params = {k: v for k, v in params.items() if v is not None or getattr(policy, k) is None}
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "params": params}


def describe_model(model) -> dict:
    """Name, class, sizes and dtype of a `transformers` model (or the repr of anything else,
    e.g. a sim `LatencyModel`)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {"repr": repr(model)}
    from ..deferred import DeferredModel

    try:
        p = model if isinstance(model, DeferredModel) else next(model.parameters())
        dtype, device = str(p.dtype).removeprefix("torch."), str(p.device)
    except (StopIteration, AttributeError, TypeError):
        dtype = device = None
    cls = (cfg.architectures or ["?"])[0] if isinstance(model, DeferredModel) else type(model).__name__
    return {
        "class": cls,
        "name_or_path": str(getattr(cfg, "_name_or_path", "")),
        "model_type": getattr(cfg, "model_type", None),
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "dtype": dtype,
        "device": device,
    }


def describe_router(router) -> dict:
    """Models (smallest first) and engine settings of a `Router`."""
    cfg = router.config
    info = getattr(router.models, "info", router.models.__getitem__)  # a model loaded elsewhere stays there
    return {
        "models": {n: describe_model(info(n)) for n in router.models},
        "tokenizer": type(router.tokenizer).__name__ + ":" + str(getattr(router.tokenizer, "name_or_path", "")),
        "mode": cfg.mode,
        "retain_kv": cfg.retain_kv,
        "prefix_cache": cfg.prefix_cache,
        "thresholds": _jsonable(router.thresholds),
        "max_batch_tokens": cfg.max_batch_tokens,
        "transport": router.transport_name,
    }


def library_versions() -> dict:
    """Versions of Python and the libraries a sweep's numbers depend on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for lib in ("tokenrouter-sdk", "torch", "transformers", "datasets", "evaluate", "math-verify", "plotly"):
        try:
            out[lib] = version(lib)
        except PackageNotFoundError:
            out[lib] = None
    try:
        import torch

        out["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        pass
    return out


def config_hash(*parts) -> str:
    """sha256 (hex, 16 chars) of the JSON of ``parts`` with sorted keys."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n (Wilson 1927, JASA 22(158); default
    z gives 95%). Returns (low, high) in [0, 1]; (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    den = 1 + z2 / n
    center = (p + z2 / (2 * n)) / den
    half = z * ((p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5) / den
    return max(0.0, center - half), min(1.0, center + half)


def binomial_range(n: int, p: float, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` range of k/n for k ~ Binomial(n, p): (lo, hi) with
    P(k/n < lo) <= (1 - level)/2 and P(k/n > hi) <= (1 - level)/2 (exact, from the binomial
    CDF). The share a random reference draws with probability p on n independent draws falls
    outside it with probability at most 1 - level. (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    if p <= 0 or p >= 1:
        return (float(p >= 1),) * 2
    tail = (1 - level) / 2
    log_p, log_q = math.log(p), math.log1p(-p)
    acc, lo, hi = 0.0, None, n
    for k in range(n + 1):
        acc += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q)
        if lo is None and acc > tail:
            lo = k
        if acc >= 1 - tail:
            hi = k
            break
    return (lo or 0) / n, hi / n
