"""Decode-step latency of a real model as a function of batch size (the planner's latency input)."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import numpy as np

from ..backends.sim_runner import LatencyModel


def profile_latency(
    runner_or_model,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    *,
    context: int = 64,
    steps: int = 5,
    warmup: int = 2,
    extend_tokens: int = 16,
    vocab_limit: int | None = None,
    seed: int = 0,
    cuda_graphs: bool = False,
) -> LatencyModel:
    """Measure one model's decode-step latency as a function of batch size.

    For each batch size b: prefill b requests of ``context`` random tokens, run ``warmup`` decode
    steps, then time ``steps`` more (one token per request each, KV growing as in serving) and keep
    the median. ``per_token_s`` comes from one extend of ``extend_tokens`` tokens at batch size 1
    (seconds per fed token beyond the first). Blocks are freed afterwards.

    Args:
        runner_or_model: a `TorchRunner`, or a `transformers` causal LM (wrapped in a `TorchRunner`,
            which switches its attention implementation to the paged one, as `Router` does).
        batch_sizes: batch sizes to time.
        context: tokens in each request's KV before the timed steps.
        steps, warmup: timed and untimed decode steps per batch size.
        extend_tokens: size of the extend used for ``per_token_s`` (0 or 1: per_token_s = 0).
        vocab_limit: draw random token ids below this (default: the runner's vocabulary).
        seed: token draws.
        cuda_graphs: when given a model, profile it with ``TorchRunner(cuda_graphs=True)`` (as the
            sub-servers of a ``Router(cuda_graphs=True)`` run it).

    Returns:
        a `LatencyModel` with ``table = {b: median seconds}``.
    """
    import torch

    from ..backends.torch_runner import TorchRunner
    from ..engine.core.block_allocator import blocks_of
    from ..engine.runner import SeqInput

    runner = runner_or_model
    if not hasattr(runner, "forward") or not hasattr(runner, "pool"):
        need = (max(batch_sizes) + 1) * (context + warmup + steps + extend_tokens + 2)
        runner = TorchRunner(runner_or_model, max_kv_tokens=max(need, 1024), cuda_graphs=cuda_graphs)
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"profile_latency: batch_sizes must be >= 1, got {batch_sizes}")
    if steps < 1:
        raise ValueError(f"profile_latency: steps must be >= 1, got {steps}")
    vocab = vocab_limit or runner.vocab_size
    rng = np.random.default_rng(seed)
    blocks = blocks_of(runner)  # the runner's own allocator: a sub-server over it never gets these blocks

    def run(seqs: list[list[int]], tables: list[list[int]], lens: list[int], feed: list[list[int]]) -> float:
        inputs = []
        for toks, tab, n in zip(feed, tables, lens):
            blocks.ensure(tab, n + len(toks))
            inputs.append(SeqInput(list(toks), n, tab))
        t0 = time.perf_counter()
        logits = runner.forward(inputs).logits
        dt = time.perf_counter() - t0
        nxt = logits.argmax(-1).tolist()
        for i, toks in enumerate(feed):
            lens[i] += len(toks)
            seqs[i].extend(toks)
            seqs[i].append(int(nxt[i]) % vocab)
        return dt

    table: dict[int, float] = {}
    per_token_s = 0.0
    with torch.inference_mode():
        for b in sorted(set(int(x) for x in batch_sizes)):
            tables: list[list[int]] = [[] for _ in range(b)]
            try:
                seqs = [[] for _ in range(b)]
                lens = [0] * b
                run(seqs, tables, lens, [rng.integers(0, vocab, context).tolist() for _ in range(b)])
                times = []
                for k in range(warmup + steps):
                    dt = run(seqs, tables, lens, [[s[-1]] for s in seqs])
                    if k >= warmup:
                        times.append(dt)
                table[b] = statistics.median(times)
                if b == min(batch_sizes) and extend_tokens > 1:
                    ext = []
                    for _ in range(max(1, steps // 2 + 1)):
                        ext.append(
                            run(seqs[:1], tables[:1], lens[:1], [rng.integers(0, vocab, extend_tokens).tolist()])
                        )
                    dec = table[b] if b == 1 else run(seqs[:1], tables[:1], lens[:1], [[seqs[0][-1]]])
                    per_token_s = max(0.0, (statistics.median(ext) - dec) / (extend_tokens - 1))
            finally:
                for t in tables:
                    blocks.free(t)
    return LatencyModel(table=table, per_token_s=per_token_s)
