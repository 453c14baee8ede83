"""Agreement and speed of a self-draft against its large model."""

from __future__ import annotations

import statistics
import time

import torch


@torch.no_grad()
def agreement(model, seqs: list[list[int]], prompt_lens: list[int]) -> dict:
    """Teacher-forced greedy agreement of ``model`` along sequences whose tokens after
    ``prompt_lens[i]`` are the large model's greedy continuation.

    Returns ``{"agreement": fraction of continuation positions where argmax(model) equals the next
    token, "first_token": the same at the first answer token only, "positions": count}``."""
    hit = n = first_hit = 0
    for ids, p in zip(seqs, prompt_lens):
        if len(ids) <= p:
            continue
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits[0]
        pred = logits[p - 1 : len(ids) - 1].argmax(-1).cpu()
        gold = torch.tensor(ids[p:])
        hit += int((pred == gold).sum())
        n += len(gold)
        first_hit += int(pred[0] == gold[0])
    return {"agreement": hit / max(1, n), "first_token": first_hit / max(1, len(seqs)), "positions": n}


@torch.no_grad()
def step_time_ratio(small, large, batch_sizes=(1, 8), prompt_tokens: int = 128, steps: int = 12) -> dict:
    """Median decode-step seconds of each model (HF KV cache, after a ``prompt_tokens`` prefill) at
    each batch size, and the ratio small/large (lower is faster)."""
    from transformers import DynamicCache

    out = {}
    for B in batch_sizes:
        row = {}
        for name, mdl in (("small", small), ("large", large)):
            vocab = mdl.get_input_embeddings().weight.shape[0]
            ids = torch.randint(0, min(10000, vocab), (B, prompt_tokens), generator=torch.Generator().manual_seed(0))
            cache = DynamicCache()
            o = mdl(input_ids=ids.to(mdl.device), cache=cache, use_cache=True, logits_to_keep=1)
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                o = mdl(input_ids=nxt, cache=cache, use_cache=True)
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - t0)
            row[name] = statistics.median(times[2:])
        row["ratio"] = row["small"] / row["large"]
        out[f"B={B}"] = row
    return out
