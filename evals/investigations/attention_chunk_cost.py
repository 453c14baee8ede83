"""Whether the CPU attention kernel's split-K chunk size is worth measuring per machine: 30
layers of decode attention in SmolLM2-135M's shapes (3 KV heads, 9 query heads, head size 64,
16-token blocks, random pool) for several batches and contexts, with the kernel's own choice
(``chunk=0``: enough chunks to give every thread two tasks, 32 to 2,048 keys each) and with
fixed chunk sizes. Median of ``--repeats`` timed runs per cell, after one warm-up; the cells of a
case run in a shuffled order (the first cell measured runs on a colder cache).

Run:
    flock /tmp/bench.lock .venv/bin/python evals/investigations/attention_chunk_cost.py --out evals/results/throughput

Writes ``<out>/attention_chunk_cost.json`` and ``.csv`` (ms per step per case and chunk size, and
the ratio of the kernel's choice to the best fixed size).
"""

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

CASES = [(1, 1100), (2, 1100), (2, 2048), (4, 300), (8, 250), (8, 1024), (16, 800)]  # requests, keys
CHUNKS = [0, 32, 64, 128, 256, 512, 1024, 2048]


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--repeats", type=int, default=15, help="timed steps per cell (default 15)")
    args = p.parse_args(argv)

    import torch

    from tokenrouter_sdk.backends import cpu_kernels

    op = cpu_kernels.paged_attention_op(wait=True)
    if op is None:
        print(f"the CPU kernel could not be built: {cpu_kernels.error()}")
        return 1
    bs, hkv, h, d, layers, blocks = 16, 3, 9, 64, 30, 1024
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(blocks * bs, hkv, d, generator=g) for _ in range(layers)]
    v = [torch.randn(blocks * bs, hkv, d, generator=g) for _ in range(layers)]
    order = random.Random(0)

    def slots(b, keys):
        perm, own, pos = torch.randperm(blocks, generator=g).tolist(), -(-keys // bs), torch.arange(keys)
        kv = torch.zeros(b, keys, dtype=torch.long)
        for i in range(b):
            table = torch.tensor(perm[i * own : (i + 1) * own])
            kv[i] = table[pos // bs] * bs + pos % bs
        return kv

    rows = []
    for b, keys in CASES:
        kv, q = slots(b, keys), torch.randn(b, h, d, generator=g)
        out, ones, lens, starts = (
            torch.empty_like(q),
            torch.ones(b, dtype=torch.long),
            torch.full((b,), keys),
            torch.arange(b),
        )
        ms = {}
        for c in order.sample(CHUNKS, len(CHUNKS)):

            def step():
                for layer in range(layers):
                    op(out, q, k[layer], v[layer], kv, starts, ones, lens, 0.125, c)

            step()
            ts = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t)
            ms[c] = statistics.median(ts) * 1e3
        best = min(ms, key=ms.get)
        rows.append(
            {
                "requests": b,
                "keys": keys,
                **{f"chunk{c or '_own'}_ms": round(ms[c], 3) for c in CHUNKS},
                "best": best,
                "own_over_best": round(ms[0] / ms[best], 3),
            }
        )
        print(
            f"{b:3d} x {keys:5d} keys: "
            + " ".join(f"{c or 'own'}:{ms[c]:.2f}" for c in CHUNKS)
            + f"  best {best or 'own'}, own/best {ms[0] / ms[best]:.3f}",
            flush=True,
        )
    evalkit.Output(args, __file__).write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
