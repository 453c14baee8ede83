"""A decode step of the packaged large model (SmolLM2-135M-Instruct, fp32) at tensor parallelism
``--tp`` (3 by default: its 3 KV heads divide only by 1 and 3) against one rank, batch 1 and 8,
on the CPU (gloo). The two runners step alternately on the same inputs (interleaved, so the
machine's drift hits both); each rank has ``--threads`` torch threads. Reports per batch the
median step of each, the median time rank 0 spends shipping a step's inputs to the other ranks
(pickle + pyzmq ipc push) and the rest of the difference (collectives and the ranks' wait for
each other: 2 all-reduces per layer); and the largest logit difference between the two.

On a machine with fewer cores than ranks the ranks share cores: no speed-up is expected there;
the shipping and collective overheads are what this measures.

Run:
    .venv/bin/python evals/throughput/tp_step.py --tp 3 --batch 1 8 --steps 15

Writes ``<out>/tp_step_tp<tp>_b<batches>.json`` and ``.csv``.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks (default 3)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default 1 8)")
    ap.add_argument("--context", type=int, default=128, help="context of each request, tokens (default 128)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per runner and batch (default 15)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    a = ap.parse_args(argv)

    import torch

    from tokenrouter_sdk.backends.tensor_parallel import ModelRecipe, TensorParallelRunner
    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.engine.core.block_allocator import blocks_of
    from tokenrouter_sdk.engine.runner import SeqInput
    from tokenrouter_sdk.models import default_pair, smollm2_folder

    print(evalkit.environment(), flush=True)
    torch.set_num_threads(a.threads)
    large, _, _ = default_pair()
    need = max(a.batch) * (-(-(a.context + a.steps + 8) // 16) * 16) + 64
    t0 = time.perf_counter()
    tp = TensorParallelRunner(
        ModelRecipe(str(smollm2_folder()), dtype="float32"), a.tp, max_kv_tokens=need, threads=a.threads, start=True
    )
    start_s = time.perf_counter() - t0
    one = TorchRunner(large, max_kv_tokens=need)
    print(f"tp={a.tp}: ranks started in {start_s:.1f} s", flush=True)
    rows = []
    try:
        for b in a.batch:
            tabs = {}
            for r in (tp, one):
                tabs[id(r)] = []
                for _ in range(b):
                    t: list[int] = []
                    blocks_of(r).ensure(t, a.context + a.steps + 8)
                    tabs[id(r)].append(t)
                r.forward([SeqInput([5 + i] * a.context, 0, t) for i, t in enumerate(tabs[id(r)])])
            t_tp, t_one, ship, diff = [], [], [], 0.0
            for s in range(a.steps + 2):
                outs = {}
                for r, acc in ((tp, t_tp), (one, t_one)):
                    feed = [SeqInput([7 + i], a.context + s, t) for i, t in enumerate(tabs[id(r)])]
                    t0 = time.perf_counter()
                    outs[id(r)] = r.forward(feed)[0]
                    if s >= 2:
                        acc.append(time.perf_counter() - t0)
                if s >= 2:
                    ship.append(tp.ship_s)
                diff = max(diff, (outs[id(tp)] - outs[id(one)]).abs().max().item())
            for r in (tp, one):
                for t in tabs[id(r)]:
                    blocks_of(r).free(t)
            row = {
                "batch": b,
                "tp": a.tp,
                "threads_per_rank": a.threads,
                "tp1_ms": round(statistics.median(t_one) * 1e3, 2),
                "tp_ms": round(statistics.median(t_tp) * 1e3, 2),
                "ship_ms": round(statistics.median(ship) * 1e3, 3),
                "max_logit_diff": diff,
            }
            row["tp_over_tp1"] = round(row["tp_ms"] / row["tp1_ms"], 3)
            row["rest_ms"] = round(row["tp_ms"] - row["ship_ms"] - row["tp1_ms"] / a.tp, 2)
            rows.append(row)
            print(
                f"B={b}: tp1 {row['tp1_ms']:.1f} ms, tp{a.tp} {row['tp_ms']:.1f} ms (x{row['tp_over_tp1']:.2f}); "
                f"ship {row['ship_ms']:.3f} ms; collectives and waits {row['rest_ms']:.1f} ms; "
                f"logits within {diff:.1e}",
                flush=True,
            )
    finally:
        tp.release()
        one.release()
    print(
        evalkit.table(
            rows,
            [
                ("batch", "B", "d"),
                ("tp1_ms", "tp1 ms", ".1f"),
                ("tp_ms", f"tp{a.tp} ms", ".1f"),
                ("tp_over_tp1", "ratio", ".2f"),
                ("ship_ms", "ship ms", ".3f"),
                ("rest_ms", "collectives ms", ".1f"),
            ],
        )
    )
    out = evalkit.Output(a, __file__, evalkit.cells_tag(f"tp{a.tp}", b=a.batch))
    out.write(rows, ranks_start_s=start_s, command=" ".join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
