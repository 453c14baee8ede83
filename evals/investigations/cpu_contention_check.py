"""Do the two sub-server processes slow each other down on this machine? Decode-step latency of the
packaged CPU pair's models (1 torch thread, `profile_latency`) alone, then while a second process
runs the small model at batch 8 in a loop.

Run:
    .venv/bin/python evals/investigations/cpu_contention_check.py

Writes ``<out>/cpu_contention_check.json`` and ``.csv``: per model and batch size, the step ms
alone and beside the busy process.
"""

import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

BATCHES = {"large": (1, 2, 8), "small": (1, 8)}


def ms(lat) -> dict:
    return {b: round(1000 * v, 1) for b, v in lat.table.items()}


def busy(stop) -> None:
    """The competing process: the small model's decode steps at batch 8 until ``stop`` is set."""
    import torch

    torch.set_num_threads(1)
    from tokenrouter_sdk.models import default_pair
    from tokenrouter_sdk.planner.profile import profile_latency

    _, small, _ = default_pair()
    while not stop.is_set():
        profile_latency(small, (8,), steps=5, warmup=0, extend_tokens=0)


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument(
        "--settle-s", type=float, default=8.0, help="seconds to wait for the busy process to load its model (default 8)"
    )
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from tokenrouter_sdk.models import default_pair
    from tokenrouter_sdk.planner.profile import profile_latency

    large, small, _ = default_pair()
    models = {"large": large, "small": small}
    alone = {}
    for name, m in models.items():
        alone[name] = ms(profile_latency(m, BATCHES[name], steps=9, extend_tokens=0))
        print(f"{name} alone", alone[name], flush=True)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    proc = ctx.Process(target=busy, args=(stop,))
    proc.start()
    try:
        time.sleep(args.settle_s)
        beside = {}
        for name, m in models.items():
            beside[name] = ms(profile_latency(m, BATCHES[name], steps=9, extend_tokens=0))
            print(f"{name}, small busy in another process", beside[name], flush=True)
    finally:
        stop.set()
        proc.join()
    rows = [
        {"model": name, "batch": b, "alone_ms": alone[name][b], "beside_busy_ms": beside[name][b]}
        for name in models
        for b in BATCHES[name]
    ]
    print(
        evalkit.table(
            rows,
            [
                ("model", "model", "s"),
                ("batch", "batch", "d"),
                ("alone_ms", "alone ms", ".1f"),
                ("beside_busy_ms", "beside busy ms", ".1f"),
            ],
        )
    )
    evalkit.Output(args, __file__).write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
