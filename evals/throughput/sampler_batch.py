"""Time of one sampling call: the batched sampler (`tokenrouter_sdk.engine.core.sampler.sample`: tensor
ops over the batch, one argmax) against a row-by-row sampler (each row filtered alone, then
``torch.multinomial``; the sampler the engine used before), on random logits.

What runs: for each batch size B, logits [B, V] (random normal times 4, in ``--dtype``), every
row sampled with the same parameters (``--temperature``, ``--top-k``, ``--top-p``) and its own
seeded generator. The two samplers alternate within each repeat (row-by-row, batched, ...) after
one warm-up each, so machine-load noise hits both; each repeat also checks that both drew the same
tokens. Reported per B: median milliseconds of each sampler and ratio = row-by-row / batched
(> 1: the batched sampler is faster).

Run:
    .venv/bin/python evals/throughput/sampler_batch.py --batch 1 8 32 --vocab 151936 --repeats 15

Writes ``<out>/sampler_batch_<cells>.json`` (every timing and the medians) and ``.csv`` (the
medians, one line per batch size).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def row_by_row(logits, params, generators):
    """The row-by-row sampler: each sampled row filtered alone, then one ``torch.multinomial``."""
    import torch

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
            drop = cum - torch.softmax(srt, -1) > p.top_p
            row = row.scatter(0, idx, srt.masked_fill(drop, float("-inf")))
        out[i] = torch.multinomial(torch.softmax(row, -1), 1, generator=generators[i]).item()
    return out


def main() -> None:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes B (rows)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size V (Qwen2.5: 151936)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="logits dtype")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=0.9, help="1: off")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per sampler and batch size")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    import torch

    from tokenrouter_sdk.engine.core.sampler import make_generator, sample
    from tokenrouter_sdk.request import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    samplers = {"row_by_row": row_by_row, "batched": sample}
    rows, runs = [], []
    for b in args.batch:
        g = torch.Generator().manual_seed(b)
        logits = (torch.randn(b, args.vocab, generator=g) * 4).to(getattr(torch, args.dtype)).to(args.device)
        times = {name: [] for name in samplers}
        for rep in range(args.repeats + 1):  # repeat 0 warms up
            drawn = {}
            for name, fn in samplers.items():
                gens = [make_generator(1000 * rep + r, 0, args.device) for r in range(b)]
                if args.device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                drawn[name] = fn(logits, [params] * b, gens).tolist()
                dt = time.perf_counter() - t0
                if rep:
                    times[name].append(dt * 1e3)
            assert drawn["row_by_row"] == drawn["batched"], f"B={b} repeat {rep}: the samplers drew other tokens"
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append(
            {
                "batch": b,
                "vocab": args.vocab,
                "row_by_row_ms": med["row_by_row"],
                "batched_ms": med["batched"],
                "ratio": med["row_by_row"] / med["batched"],
            }
        )
        runs.append({"batch": b, **{f"{name}_ms": t for name, t in times.items()}})
        print(f"B={b}: row-by-row {med['row_by_row']:.2f} ms, batched {med['batched']:.2f} ms", flush=True)
    print(
        evalkit.table(
            rows,
            [
                ("batch", "B", "d"),
                ("vocab", "V", "d"),
                ("row_by_row_ms", "row-by-row ms", ".2f"),
                ("batched_ms", "batched ms", ".2f"),
                ("ratio", "ratio", ".2f"),
            ],
        )
    )
    cells = evalkit.cells_tag(args.device, args.dtype, b=args.batch, k=args.top_k, p=args.top_p)
    evalkit.Output(args, __file__, cells).write(rows, runs=runs)


if __name__ == "__main__":
    main()
