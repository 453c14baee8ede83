"""What a decode step's attention over the paged KV pool costs on this CPU, per step of 30 layers
(SmolLM2-135M's shapes: 3 KV heads, 9 query heads, head size 64, 16-token blocks), for batches of
decode requests that may share leading blocks (the prefix cache gives requests behind one
prompt prefix the same blocks):

  gather    each layer gathers every request's keys and values (``index_select``), then one
            padded SDPA call (`tokenrouter_sdk.backends.attention.gather`, below the threshold)
  cascade   the shared keys once for all requests, each request's own keys apart, merged by the
            log-sum-exp (`tokenrouter_sdk.backends.attention.cascade`, used when (requests - 1) x
            shared keys >= its ``MIN_SAVED``)
  kernel    the in-place CPU kernel (`tokenrouter_sdk.backends.cpu_kernels`, what CPU steps run by
            default once it is built): reads each key's pool row once, no copy

Pool content is random; only time is measured (median of ``--repeats`` steps, after one warm-up).

Run:
    flock /tmp/bench.lock .venv/bin/python evals/investigations/paged_gather_cost.py --out evals/results/throughput

Writes ``<out>/paged_gather_cost.json`` and ``.csv`` (one row per case: ms per step per path).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

CASES = [
    (8, 250, 32),
    (2, 1200, 32),
    (2, 1200, 736),
    (4, 800, 736),
    (8, 800, 736),
    (16, 800, 736),
]  # requests, keys, shared


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--repeats", type=int, default=15, help="timed steps per case and path (default 15)")
    p.add_argument("--blocks", type=int, default=1024, help="pool blocks (default 1024 = 16,384 tokens)")
    args = p.parse_args(argv)

    import torch

    from tokenrouter_sdk.backends import attention as A
    from tokenrouter_sdk.backends import cpu_kernels
    from tokenrouter_sdk.backends.attention import cascade as C
    from tokenrouter_sdk.backends.attention import gather as G

    op = cpu_kernels.paged_attention_op(wait=True)
    if op is None:
        print(f"the CPU kernel could not be built ({cpu_kernels.error()}): its column stays empty")

    bs, hkv, h, d, layers = 16, 3, 9, 64, 30
    params = A.LayerParams(None, None, 0.125)
    g = torch.Generator().manual_seed(0)

    class Pool:
        block_size = bs
        k = [torch.randn(args.blocks * bs, hkv, d, generator=g) for _ in range(layers)]
        v = [torch.randn(args.blocks * bs, hkv, d, generator=g) for _ in range(layers)]

    def batch(b, keys, shared):
        perm = torch.randperm(args.blocks, generator=g).tolist()
        own = -(-keys // bs) - shared // bs
        kv = torch.zeros(b, keys, dtype=torch.long)
        pos = torch.arange(keys)
        for i in range(b):
            table = torch.tensor(perm[: shared // bs] + perm[shared // bs + i * own : shared // bs + (i + 1) * own])
            kv[i] = table[pos // bs] * bs + pos % bs
        return A.DecodeView(kv, None, shared)

    def timed(fn):
        fn()
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    rows = []
    for b, keys, shared in CASES:
        fb = batch(b, keys, shared)
        q = torch.randn(1, h, b, d, generator=g)
        qd = q[0].view(h, b, 1, d).transpose(0, 1)

        def gather():
            for layer in range(layers):
                G.attend_decodes(fb, params, Pool.k[layer], Pool.v[layer], qd)

        def cascade():
            for layer in range(layers):
                C.attend(fb, params, Pool.k[layer], Pool.v[layer], qd)

        qk = q[0].transpose(0, 1).contiguous()  # [B, H, D]
        out = torch.empty_like(qk)
        ones, lens = torch.ones(b, dtype=torch.long), torch.full((b,), keys, dtype=torch.long)

        def kernel():
            for layer in range(layers):
                op(out, qk, Pool.k[layer], Pool.v[layer], fb.kv, torch.arange(b), ones, lens, 0.125)

        row = {
            "requests": b,
            "keys": keys,
            "shared": shared,
            "gather_ms": timed(gather),
            "cascade_ms": timed(cascade),
            "kernel_ms": timed(kernel) if op is not None else None,
            "cascade_on": (b - 1) * shared >= C.MIN_SAVED,
        }
        rows.append(row)
        print(
            f"{b} x {keys} keys, {shared} shared: gather {row['gather_ms']:.1f} ms, "
            f"cascade {row['cascade_ms']:.1f} ms, kernel {row['kernel_ms'] or float('nan'):.1f} ms",
            flush=True,
        )
    print(
        evalkit.table(
            rows,
            [
                ("requests", "requests", "d"),
                ("keys", "keys", "d"),
                ("shared", "shared", "d"),
                ("gather_ms", "gather ms", ".1f"),
                ("cascade_ms", "cascade ms", ".1f"),
                ("kernel_ms", "kernel ms", ".1f"),
                ("cascade_on", "cascade used", ""),
            ],
        )
    )
    evalkit.Output(args, __file__).write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
