"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator so that the
same seed gives the same draws."""

from __future__ import annotations

import torch

from ..request import SamplingParams


def make_generator(seed: int | None, model_index: int, device) -> torch.Generator | None:
    """A generator for one request on one model, seeded from (seed, model_index); None
    (fresh entropy) if ``seed`` is None."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + model_index * 7919) % (2**63))
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: shape [B, V].
        params: per-row sampling parameters, length B.
        generators: per-row generators (None = global RNG), length B.

    Returns:
        token ids, shape [B] (int64, on the CPU).
    """
    out = logits.argmax(-1).cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            srt, idx = torch.sort(row, descending=True)
            cum = torch.softmax(srt, -1).cumsum(-1)
            drop = cum - torch.softmax(srt, -1) > p.top_p  # keep the smallest set with mass >= top_p
            row = row.scatter(0, idx, srt.masked_fill(drop, float("-inf")))
        probs = torch.softmax(row, -1)
        out[i] = torch.multinomial(probs, 1, generator=generators[i]).item()
    return out
