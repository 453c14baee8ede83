"""Decode-step time of the packaged large CPU model against context length: how attention over the
paged KV grows with the context (`TorchRunner.forward` on a batch of decode steps, 1 torch thread
by default). The KV content is left as allocated: only the step time is measured.

Run:
    .venv/bin/python evals/investigations/attention_context_cost.py --contexts 128 512 1024 --batch 8

Writes ``<out>/attention_context_cost_<cells>.json`` and ``.csv`` (median step ms per context).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024], help="context lengths (tokens)")
    p.add_argument("--batch", type=int, default=8, help="decode steps per forward (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per context (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)

    import torch

    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.engine.core.block_allocator import blocks_of
    from tokenrouter_sdk.engine.runner import SeqInput
    from tokenrouter_sdk.models import default_pair

    torch.set_num_threads(args.threads)
    large, _, _ = default_pair()
    runner = TorchRunner(large, max_kv_tokens=(max(args.contexts) + 16) * args.batch * 2)
    rows = []
    for ctx in args.contexts:
        tables = []
        for _ in range(args.batch):
            t: list[int] = []
            blocks_of(runner).ensure(t, ctx + 1)
            tables.append(t)
        times = []
        for _ in range(args.repeats):
            seqs = [SeqInput([5], ctx, tables[i]) for i in range(args.batch)]
            t0 = time.perf_counter()
            runner.forward(seqs)
            times.append(time.perf_counter() - t0)
        for t in tables:
            blocks_of(runner).free(t)
        rows.append({"context": ctx, "batch": args.batch, "step_ms_median": 1e3 * statistics.median(times)})
        print(
            f"context {ctx}: decode step at batch {args.batch}: median {rows[-1]['step_ms_median']:.1f} ms", flush=True
        )
    print(
        evalkit.table(
            rows, [("context", "context", "d"), ("batch", "batch", "d"), ("step_ms_median", "step ms", ".1f")]
        )
    )
    evalkit.Output(args, __file__, evalkit.cells_tag(b=args.batch, ctx=args.contexts)).write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
