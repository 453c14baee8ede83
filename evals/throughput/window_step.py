"""A decode step of a sliding-window model against the same model with its window off.

The model: random weights in SmolLM2-135M's shapes as a Mistral (30 layers, hidden 576, 9 query
and 3 KV heads of 64, vocabulary 49,152), float32, every layer with a ``--window`` key sliding
window (Mistral's attention), and a deep copy of it with ``sliding_window=None`` (full attention).
Each runner serves B decode requests at ``--context`` tokens each: their K/V are written straight
into the pool (random values; a decode step's cost does not depend on them), then decode steps
of both runners are interleaved (windowed, full, windowed, ...), one token per request per step,
``--steps`` timed steps each after two warm-ups. With the CPU kernels on (``kernels="wait"``), a
windowed layer reads the last ``--window`` keys of each request in place; full attention reads
all of them. ``--kernels off`` adds the gather path (a windowed view gathers only the window's
keys).

The table: per batch and kernels, the windowed and full step (median and min, ms) and full /
windowed (the speedup the window gives).

Run: (timing under `flock /tmp/bench.lock`: the machine is shared)
    flock /tmp/bench.lock .venv/bin/python evals/throughput/window_step.py --batch 1 4 --out evals/results/throughput

Writes ``<out>/window_step_c<context>_w<window>_b<batches>.json`` and ``.csv``.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=16384,
    tie_word_embeddings=True,
)


def models(window: int):
    """(the windowed model, the same weights with the window off)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        windowed = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)).eval().requires_grad_(False)
    full = copy.deepcopy(windowed)
    full.config.sliding_window = None  # Mistral's attention passes config.sliding_window
    return windowed, full


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="decode batch sizes (default 1 4)")
    ap.add_argument("--context", type=int, default=4096, help="context of each request, tokens (default 4096)")
    ap.add_argument("--window", type=int, default=512, help="the sliding window, keys (default 512)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per runner and batch (default 15)")
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["wait"],
        choices=["wait", "off"],
        help="the runners' kernels setting(s) (default wait: the C++ CPU kernels)",
    )
    a = ap.parse_args(argv)

    import torch

    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.engine.core.block_allocator import blocks_of
    from tokenrouter_sdk.engine.runner import SeqInput

    print(evalkit.environment(), flush=True)
    windowed, full = models(a.window)
    need = max(a.batch) * (a.context + a.steps + 16)
    rows = []
    g = torch.Generator().manual_seed(1)
    for kernels in a.kernels:
        runners = {
            "windowed": TorchRunner(windowed, max_kv_tokens=need, kernels=kernels),
            "full": TorchRunner(full, max_kv_tokens=need, kernels=kernels),
        }
        assert {p.window for p in runners["windowed"].spec.layers} == {a.window}
        assert {p.window for p in runners["full"].spec.layers} == {None}
        for b in a.batch:
            tabs = {}
            for name, r in runners.items():
                tabs[name] = []
                for _ in range(b):
                    t: list[int] = []
                    blocks_of(r).ensure(t, a.context + a.steps + 8)
                    slots = r.pool.slots(t, 0, a.context)
                    for layer in range(len(r.pool.k)):
                        r.pool.k[layer][slots] = torch.randn(len(slots), *r.pool.k.shape[2:], generator=g)
                        r.pool.v[layer][slots] = torch.randn(len(slots), *r.pool.v.shape[2:], generator=g)
                    tabs[name].append(t)
            times = {name: [] for name in runners}
            for s in range(a.steps + 2):
                for name, r in runners.items():
                    feed = [SeqInput([7 + i], a.context + s, t) for i, t in enumerate(tabs[name])]
                    t0 = time.perf_counter()
                    r.forward(feed)
                    if s >= 2:
                        times[name].append(time.perf_counter() - t0)
            for name, r in runners.items():
                for t in tabs[name]:
                    blocks_of(r).free(t)
            row = {"batch": b, "kernels": kernels, "context": a.context, "window": a.window}
            for name, ts in times.items():
                row[f"{name}_ms"] = round(statistics.median(ts) * 1e3, 2)
                row[f"{name}_min_ms"] = round(min(ts) * 1e3, 2)
            row["full_over_windowed"] = round(row["full_ms"] / row["windowed_ms"], 3)
            rows.append(row)
            print(
                f"B={b} kernels={kernels}: windowed {row['windowed_ms']:.1f} ms (min {row['windowed_min_ms']:.1f}), "
                f"full {row['full_ms']:.1f} ms (min {row['full_min_ms']:.1f}), "
                f"full/windowed x{row['full_over_windowed']:.2f}",
                flush=True,
            )
        for r in runners.values():
            r.release()
    print(
        evalkit.table(
            rows,
            [
                ("batch", "B", "d"),
                ("kernels", "kernels", ""),
                ("windowed_ms", "windowed ms", ".1f"),
                ("full_ms", "full ms", ".1f"),
                ("full_over_windowed", "full/windowed", ".2f"),
            ],
        )
    )
    out = evalkit.Output(a, __file__, evalkit.cells_tag(c=a.context, w=a.window, b=a.batch))
    out.write(rows, command=" ".join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
