"""Decode-step time of the large CPU model against context length (TorchRunner.forward, 1 thread,
batch 8): how attention over the paged KV grows with the context.

    .venv/bin/python evals/attention_context_cost.py
"""
import time, torch
from tokenrouter_sdk.models import default_pair
from tokenrouter_sdk.backends.torch_runner import TorchRunner
from tokenrouter_sdk.engine.runner import SeqInput
torch.set_num_threads(1)
large, small, tok = default_pair()
r = TorchRunner(large, max_kv_tokens=16384)
for L in (128, 512, 1024):
    tables = []
    seqs = []
    for i in range(8):
        t = []; r.pool.ensure(t, L + 1); tables.append(t)
    # prefill garbage KV is fine: just time decode steps
    ts = []
    for rep in range(5):
        seqs = [SeqInput([5], L, tables[i]) for i in range(8)]
        t0 = time.perf_counter(); r.forward(seqs); ts.append(time.perf_counter() - t0)
    for t in tables: r.pool.free(t)
    print(L, "decode B=8 step ms median", sorted(ts)[2] * 1e3)
