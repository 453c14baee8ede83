"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator so that the
same seed gives the same draws.

`sample` filters the whole batch with tensor ops (per-row parameters as ``[B, 1]`` tensors) and
draws with one argmax. The draw is the exponential race that ``torch.multinomial(probs, 1)``
runs (ATen's ``multinomial``: ``argmax(probs / q)`` with ``q ~ Exponential(1)`` drawn into a
tensor shaped like one row), so each row consumes its generator exactly as a per-row
``torch.multinomial`` call does. On the CPU the filtered logits are bit for bit those of filtering
each row alone (the same rounding of the temperature, the same sort order among equal values), so
a seed gives the same tokens as a row-by-row sampler.
"""

from __future__ import annotations

import torch

from ...request import SamplingParams


def make_generator(seed: int | None, model_index: int, device) -> torch.Generator | None:
    """A generator for one request on one model, seeded from (seed, model_index); None
    (fresh entropy) if ``seed`` is None."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + model_index * 7919) % (2**63))
    return g


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Sample one token per row.

    Greedy rows (``temperature == 0``) take the argmax of ``logits`` as given. The other rows are
    computed in float32: logits / temperature; top-k (Fan et al. 2018, "Hierarchical Neural Story
    Generation") keeps every value >= the k-th largest (ties at the k-th value stay; ``top_k`` 0
    or >= V keeps all); top-p keeps the smallest prefix of the descending order whose mass is
    >= ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", section
    3.1; ``top_p`` 1 keeps all); then one draw from the softmax with the row's generator (None:
    the device's global generator).

    Args:
        logits: shape [B, V], any floating dtype, on the generators' device.
        params: per-row sampling parameters, length B.
        generators: per-row generators (None = global RNG), length B.

    Returns:
        token ids, shape [B] (int64, on the CPU).

    Raises:
        RuntimeError: a sampled row's probabilities hold NaN (NaN or +inf logits, or no finite
            logit left), naming the rows.
    """
    out = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out.cpu()
    if len(rows) == len(params):
        x = logits.float()
    else:
        x = logits[torch.tensor(rows, device=logits.device)].float()
    chosen = [params[i] for i in rows]
    x = _scale(x, [p.temperature for p in chosen])
    x = _top_k(x, [p.top_k for p in chosen])
    x = _top_p(x, [p.top_p for p in chosen])
    probs = torch.softmax(x, -1)
    tokens = (probs / _exponentials(probs, [generators[i] for i in rows])).argmax(-1)
    bad = probs.gather(1, tokens[:, None]).isnan().squeeze(1)
    if len(rows) == len(params):
        out = tokens
    else:
        out[torch.tensor(rows, device=out.device)] = tokens
    bad, out = bad.cpu(), out.cpu()
    if bool(bad.any()):
        nan_rows = [rows[j] for j in bad.nonzero().flatten().tolist()]
        raise RuntimeError(
            f"sampling rows {nan_rows}: the probabilities hold NaN (the logits hold NaN or +inf, "
            "or no finite logit is left); check the model's logits for these requests"
        )
    return out


def _column(values: list, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a [B, 1] tensor of ``dtype`` on ``like``'s device."""
    return torch.tensor(values, dtype=dtype).reshape(-1, 1).to(like.device, non_blocking=True)


def _scale(x: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """``x`` [B, V] float32 divided by each row's temperature, rounded as ``x / t`` with a Python
    float ``t`` rounds on that device: CUDA multiplies by the float32 reciprocal of a scalar
    divisor, the CPU divides."""
    t = torch.tensor(temperatures, dtype=torch.float32).reshape(-1, 1)
    if x.device.type == "cuda":
        return x * (1.0 / t).to(x.device, non_blocking=True)
    return x / t.to(x.device, non_blocking=True)


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """``x`` [B, V] with the values below each row's k-th largest set to -inf (rows with k 0,
    None or >= V unchanged)."""
    vocab = x.shape[-1]
    active = [bool(k) and k < vocab for k in ks]
    if not any(active):
        return x
    kmax = max(k for k, a in zip(ks, active) if a)
    position = _column([k - 1 if a else 0 for k, a in zip(ks, active)], x, torch.long)
    kth = torch.topk(x, kmax, dim=-1).values.gather(1, position)
    kth = kth.masked_fill(~_column(active, x, torch.bool), float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """``x`` [B, V] with each row cut to the smallest prefix of its descending order whose
    softmax mass is >= the row's ``top_p`` (rows with ``top_p`` 1 unchanged). The order among
    equal values is ``torch.sort``'s (default, not stable) of the row as given."""
    active = [p < 1.0 for p in ps]
    if not any(active):
        return x
    srt, idx = torch.sort(x, dim=-1, descending=True)
    mass = torch.softmax(srt, -1)
    drop = (mass.cumsum(-1) - mass > _column(ps, x, torch.float32)) & _column(active, x, torch.bool)
    return x.scatter(1, idx, srt.masked_fill(drop, float("-inf")))


def _exponentials(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential(1) noise shaped like ``probs`` [B, V], row i drawn with ``generators[i]`` as
    one ``[V]`` tensor (None: the global generator), in row order: the draw
    ``torch.multinomial(probs[i], 1, generator=generators[i])`` makes."""
    q = torch.empty_like(probs)
    for i, g in enumerate(generators):
        q[i].exponential_(generator=g)
    return q
