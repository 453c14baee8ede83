"""A decode step against the memory-bandwidth bound, eager and compiled, for both models of the
packaged pair (SmolLM2-135M-Instruct and its self-draft: 12 shared layers + 2).

What it measures, in one process:
  bandwidth   over a 1 GiB float32 tensor (advised for huge pages on Linux, as the engine's
              packed weights are), all threads, best and median of ``--copies``: a copy
              into another tensor (torch ``copy_``: bytes read per second; the copy also writes
              as many) and a sum (reads only). The bound takes the higher best: on a 2-core AMD
              EPYC VM the copy read 22-38 GB/s from run to run, the sum a steady 46-48 GB/s, and
              a batch-1 decode step streams its weights at 42-54 GB/s, faster than the copy.
              The sum is timed again just before and just after each (model, batch) cell's
              steps: a VM's memory can change its rate within minutes (this one read 41-52 or
              71-82 GB/s), so a cell is held to the highest rate of the three, and a cell whose
              before and after differ by over 15% is flagged (``rate_changed``). The ratios
              at the cell's own rate (the higher of its before and after: ``cell GB/s``) are
              printed beside them: a cell that ran wholly at a slow rate after a first
              measurement at a fast one is otherwise held to a rate it never saw.
  bound       weights bytes / read bandwidth: a decode step reads every weight once (the tied
              embedding once, through the LM head), so it cannot take less; ``bound+KV`` adds
              each request's cached keys and values (``--context`` tokens, every layer), read
              once by attention: the bound of a step at a long context.
  step        the `TorchRunner` forward of a batch of B decodes (context ``--context`` tokens
              each), eager (``compile=False``) and compiled (``compile="wait"``) runners of the
              same model (the default native forward, with the C++ CPU kernels: ``kernels="wait"``),
              the eager one again with ``kernels="off"`` (ATen ops, attention over a gathered
              copy), and an eager runner of the transformers forward (``model_impl="transformers"``,
              ``kernels="off"``: the step before the native forward), in runs of ``--run``
              consecutive steps per runner, the runners taking turns (transformers, eager, no
              kernels, compiled, transformers, ...: a memory's change of rate falls on all of
              them), after one untimed round; a run's first step is not timed, since it follows
              another runner's step, whose data evicted this one's from the caches (about 10%
              slower at batch 8 on a 2-core AMD EPYC: the case of a routed pair's hand-offs,
              not of one model decoding, which the bound is about; ``--run 1`` times every step
              interleaved); median and min of ``--steps``. The compiled runner's compile time is
              printed (cold or warm: inductor's disk cache).
  GEMM floor  the step's projections at B rows with their weights in the cache: each layer
              projection (q/k/v, o, gate/up, down of layer 0, through the path the eager step
              runs for B rows) timed over ``--gemm-reps`` consecutive calls on the same weight
              (median), times the layer count, plus the LM head's FLOPs at the best of those
              rates (its weight never fits a cache). A step cannot take less than its GEMMs at
              this rate whatever the memory reads; ``roofline`` is the larger of the floor and
              bound+KV. On a 2-core AMD EPYC (Zen 5) the float32 batch-8 floor of the large
              model was 5.3 ms (the few-row kernel at 422 GFLOPS, the cores' FMA peak) against a
              6.8 ms bound at 80 GB/s: the step's FMAs take 80% of its weights' read time, so
              the bound holds only where each core streams and computes at once at near peak.
The table: per model and batch, transformers-forward ms, eager ms, compiled ms, eager's speedup
over the transformers forward, each over the bound, the GEMM floor and eager over the roofline,
and small:large step ratio.

Run: (timing under `flock /tmp/bench.lock`: the machine is shared)
    flock /tmp/bench.lock .venv/bin/python evals/throughput/step_bound.py --batch 1 8 --out evals/results/throughput
    ... --dtype bfloat16     # bf16 weights and KV (this CPU has avx512_bf16/AMX)

Writes ``<out>/step_bound_<dtype>_b<batches>.json`` and ``.csv``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def _huge_pages(nbytes: int):
    """A float32 tensor of ``nbytes`` in its own 2 MiB-aligned mapping advised MADV_HUGEPAGE, as
    the engine packs its few-row weights (on Linux; elsewhere torch's allocator), so the bound
    is measured on memory as fast as the step's."""
    import torch

    if not sys.platform.startswith("linux"):
        return torch.empty(nbytes // 4)
    import ctypes
    import mmap

    huge = 2 << 20
    buf = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    off = (-addr) % huge
    ctypes.CDLL(None).madvise(ctypes.c_void_p(addr + off), ctypes.c_size_t(nbytes), 14)  # MADV_HUGEPAGE: a hint
    return torch.frombuffer(buf, dtype=torch.float32, count=nbytes // 4, offset=off)


def copy_bandwidth(n: int):
    """Read bandwidth two ways over a 1 GiB float32 tensor on huge pages where the system
    gives them (`_huge_pages`), all threads, best and median of
    ``n``: ``copy`` (``copy_`` into another tensor; bytes read per second, the copy also
    writes as many) and ``sum`` (a reduction: reads only, as a decode step reads its
    weights). ``read_gb_s_best`` is the higher of the two bests: the bound a step is held to.
    Returns (those figures, dict; the 1 GiB tensor, for `sum_bandwidth` later)."""
    x, y = _huge_pages(1 << 30), _huge_pages(1 << 30)  # 1 GiB of float32 each
    x.fill_(1.0)
    y.zero_()
    b = x.numel() * 4
    out = {}
    for name, f in (("copy", lambda: y.copy_(x)), ("sum", lambda: x.sum())):
        ts = _times(f, n)
        out[f"{name}_gb_s_best"] = b / min(ts) / 1e9
        out[f"{name}_gb_s_median"] = b / statistics.median(ts) / 1e9
    out["read_gb_s_best"] = max(out["copy_gb_s_best"], out["sum_gb_s_best"])
    out["read_gb_s_median"] = max(out["copy_gb_s_median"], out["sum_gb_s_median"])
    return out, x


def _times(f, n: int) -> list[float]:
    """Seconds of ``n`` calls of ``f`` after an untimed one."""
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return ts


def sum_bandwidth(x, n: int = 5) -> float:
    """The best of ``n`` timed sums over ``x`` (the 1 GiB tensor of `copy_bandwidth`), GB/s read."""
    return x.numel() * x.element_size() / min(_times(x.sum, n)) / 1e9


def gemm_floor(runner, rows: int, reps: int) -> dict:
    """The eager step's projections at ``rows`` rows with their weights in the cache (see the
    module docstring): ``{"gemm_floor_ms", "gemm_gflops_best", "gemm_layer_ms"}``; ms per step."""
    import torch

    nf = runner._native_forward()
    projs, layers = nf.projections, len(nf._plan)
    per_layer, head = projs[:4], projs[-1]
    best, layer_s = 0.0, 0.0
    with torch.inference_mode():
        for p in per_layer:
            x = torch.randn(rows, p.mods[0].in_features, dtype=p.mods[0].weight.dtype)
            ts = _times(lambda: p.merged(x), reps + 2)[2:]  # the first calls bring the weight in
            t = statistics.median(ts)
            layer_s += t
            best = max(best, 2 * rows * p.mods[0].in_features * sum(p.sizes) / t / 1e9)
    head_flops = 2 * rows * head.mods[0].in_features * sum(head.sizes)
    floor_s = layer_s * layers + head_flops / (best * 1e9)
    return {
        "gemm_floor_ms": round(floor_s * 1e3, 2),
        "gemm_gflops_best": round(best, 1),
        "gemm_layer_ms": round(layer_s * 1e3, 3),
    }


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default 1 8)")
    ap.add_argument("--context", type=int, default=200, help="context of each request, tokens (default 200)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per runner and batch (default 15)")
    ap.add_argument(
        "--run",
        type=int,
        default=3,
        help="consecutive timed steps of one runner before the next runner's (default 3; 1: steps "
        "interleaved one by one)",
    )
    ap.add_argument("--copies", type=int, default=10, help="timed copies for the bandwidth (default 10)")
    ap.add_argument(
        "--gemm-reps", type=int, default=20, help="consecutive calls per projection for the GEMM floor (default 20)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args(argv)

    import torch

    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.engine.core.block_allocator import blocks_of
    from tokenrouter_sdk.engine.runner import SeqInput
    from tokenrouter_sdk.models import default_pair

    print(evalkit.environment(), flush=True)
    large, small, _ = default_pair(dtype=getattr(torch, a.dtype))
    bw, big = copy_bandwidth(a.copies)
    rows = []
    print(
        f"read bandwidth: copy {bw['copy_gb_s_best']:.1f} GB/s best ({bw['copy_gb_s_median']:.1f} median), "
        f"sum {bw['sum_gb_s_best']:.1f} GB/s best ({bw['sum_gb_s_median']:.1f} median); bound at "
        f"{bw['read_gb_s_best']:.1f} GB/s",
        flush=True,
    )
    steps: dict = {}
    for name, model in (("large", large), ("small", small)):
        wb = weight_bytes(model)
        bound_ms = wb / (bw["read_gb_s_best"] * 1e9) * 1e3
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_per_token = (
            2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()
        )
        need = max(a.batch) * (-(-(a.context + a.steps * 4 + 16) // 16) * 16)
        hf = TorchRunner(model, max_kv_tokens=need + 64, model_impl="transformers", kernels="off")
        eager = TorchRunner(model, max_kv_tokens=need + 64, kernels="wait")
        nok = TorchRunner(model, max_kv_tokens=need + 64, kernels="off")
        comp = TorchRunner(model, max_kv_tokens=need + 64, compile="wait")
        t0 = time.perf_counter()
        comp.wait_compiled()
        compile_s = time.perf_counter() - t0
        print(
            f"{name}: {wb / 1e6:.0f} MB of weights, bound {bound_ms:.1f} ms; compile {compile_s:.1f} s "
            f"({comp.compile_error or 'ok'})",
            flush=True,
        )
        for b in a.batch:
            tabs = {}
            for r in (hf, eager, nok, comp):
                tabs[id(r)] = []
                for _ in range(b):
                    t: list[int] = []
                    blocks_of(r).ensure(t, a.context + a.steps * 4 + 16)
                    tabs[id(r)].append(t)
                r.forward([SeqInput([5 + i] * a.context, 0, t) for i, t in enumerate(tabs[id(r)])])
            th, te, tn, tc = [], [], [], []
            before = sum_bandwidth(big)
            pos = {id(r): a.context for r in (hf, eager, nok, comp)}
            ctx_timed = []
            for rnd in range(1 + -(-a.steps // a.run)):  # round 0 warms every runner up: not timed
                for r, acc in ((hf, th), (eager, te), (nok, tn), (comp, tc)):
                    for j in range(a.run + 1):  # a run's first step follows another runner's: not timed
                        feed = [SeqInput([7 + i], pos[id(r)], t) for i, t in enumerate(tabs[id(r)])]
                        t0 = time.perf_counter()
                        r.forward(feed)
                        dt = time.perf_counter() - t0
                        if rnd > 0 and j > 0:
                            acc.append(dt)
                            ctx_timed.append(pos[id(r)])
                        pos[id(r)] += 1
            after = sum_bandwidth(big)
            for r in (hf, eager, nok, comp):
                for t in tabs[id(r)]:
                    blocks_of(r).free(t)
            # a VM's memory may change its rate during a run: the cell is held to the highest rate
            # of the first measurement and the sums just before and just after its steps
            read = max(bw["read_gb_s_best"], before, after)
            cell_bound_ms = wb / (read * 1e9) * 1e3
            changed = max(before, after) > 1.15 * min(before, after)
            if changed:
                print(
                    f"  B={b}: the memory's read rate changed during these steps (sum {before:.1f} GB/s before, "
                    f"{after:.1f} after): their ratio to the bound mixes two rates",
                    flush=True,
                )
            row = {
                "model": name,
                "batch": b,
                "dtype": a.dtype,
                "weights_mb": round(wb / 1e6, 1),
                "sum_before_gb_s": round(before, 1),
                "sum_after_gb_s": round(after, 1),
                "read_gb_s": round(read, 1),
                "rate_changed": changed,
                "bound_ms": round(cell_bound_ms, 2),
                "transformers_ms": round(statistics.median(th) * 1e3, 2),
                "eager_ms": round(statistics.median(te) * 1e3, 2),
                "nokernels_ms": round(statistics.median(tn) * 1e3, 2),
                "compiled_ms": round(statistics.median(tc) * 1e3, 2),
                "eager_min_ms": round(min(te) * 1e3, 2),
                "compiled_min_ms": round(min(tc) * 1e3, 2),
                "compile_s": round(compile_s, 1),
            }
            row["speedup"] = round(row["eager_ms"] / row["compiled_ms"], 3)
            row["native_speedup"] = round(row["transformers_ms"] / row["eager_ms"], 3)
            row["eager_over_bound"] = round(row["eager_ms"] / cell_bound_ms, 2)
            row["copy_bound_ms"] = round(wb / (bw["copy_gb_s_best"] * 1e9) * 1e3, 2)  # the copy's figure alone
            row["eager_over_copy_bound"] = round(row["eager_ms"] / row["copy_bound_ms"], 2)
            kv_bytes = b * statistics.mean(ctx_timed) * kv_per_token  # the mean context over the timed steps
            row["kv_mb"] = round(kv_bytes / 1e6, 1)
            row["bound_kv_ms"] = round((wb + kv_bytes) / (read * 1e9) * 1e3, 2)
            row["eager_over_bound_kv"] = round(row["eager_ms"] / row["bound_kv_ms"], 2)
            # the same at the cell's own rate (the higher of the sums just before and after its steps):
            # a VM whose memory moved between the first measurement and the cell ran it at this one
            cell = max(before, after)
            row["cell_read_gb_s"] = round(cell, 1)
            row["eager_over_cell_bound"] = round(row["eager_ms"] / (wb / (cell * 1e9) * 1e3), 2)
            row["eager_over_cell_bound_kv"] = round(row["eager_ms"] / ((wb + kv_bytes) / (cell * 1e9) * 1e3), 2)
            row["compiled_over_bound_kv"] = round(row["compiled_ms"] / row["bound_kv_ms"], 2)
            row["compiled_over_bound"] = round(row["compiled_ms"] / cell_bound_ms, 2)
            row.update(gemm_floor(eager, b, a.gemm_reps))
            row["roofline_ms"] = max(row["gemm_floor_ms"], row["bound_kv_ms"])
            row["eager_over_roofline"] = round(row["eager_ms"] / row["roofline_ms"], 2)
            steps[(name, b)] = row
            rows.append(row)
            print(
                f"  B={b}: transformers {row['transformers_ms']:.1f} ms, eager {row['eager_ms']:.1f} ms "
                f"(no kernels {row['nokernels_ms']:.1f}) "
                f"(min {row['eager_min_ms']:.1f}), compiled "
                f"{row['compiled_ms']:.1f} ms (min {row['compiled_min_ms']:.1f}), x{row['speedup']:.2f}; "
                f"over bound {row['eager_over_bound']:.2f} / {row['compiled_over_bound']:.2f}; over bound+KV "
                f"({row['kv_mb']:.0f} MB of KV) {row['eager_over_bound_kv']:.2f} / "
                f"{row['compiled_over_bound_kv']:.2f}; "
                f"GEMM floor {row['gemm_floor_ms']:.1f} ms ({row['gemm_gflops_best']:.0f} GFLOPS at best, weights "
                f"in cache), eager over the roofline {row['eager_over_roofline']:.2f}; at the cell's own rate "
                f"({row['cell_read_gb_s']:.1f} GB/s) eager over bound {row['eager_over_cell_bound']:.2f}, over "
                f"bound+KV {row['eager_over_cell_bound_kv']:.2f}",
                flush=True,
            )
        for r in (hf, eager, nok, comp):
            r.release()
    for b in a.batch:
        s, lg = steps[("small", b)], steps[("large", b)]
        for row in (s, lg):
            row["small_large_transformers"] = round(s["transformers_ms"] / lg["transformers_ms"], 3)
            row["small_large_eager"] = round(s["eager_ms"] / lg["eager_ms"], 3)
            row["small_large_compiled"] = round(s["compiled_ms"] / lg["compiled_ms"], 3)
        print(
            f"small:large step at B={b}: transformers {s['small_large_transformers']:.2f}, eager "
            f"{s['small_large_eager']:.2f}, compiled {s['small_large_compiled']:.2f}"
        )
    print(
        evalkit.table(
            rows,
            [
                ("model", "model", ""),
                ("batch", "B", "d"),
                ("read_gb_s", "read GB/s", ".1f"),
                ("bound_ms", "bound ms", ".1f"),
                ("transformers_ms", "transformers ms", ".1f"),
                ("eager_ms", "eager ms", ".1f"),
                ("nokernels_ms", "no kernels ms", ".1f"),
                ("compiled_ms", "compiled ms", ".1f"),
                ("native_speedup", "eager x", ".2f"),
                ("speedup", "compiled x", ".2f"),
                ("eager_over_bound", "eager/bound", ".2f"),
                ("compiled_over_bound", "compiled/bound", ".2f"),
                ("eager_over_copy_bound", "eager/copy bound", ".2f"),
                ("bound_kv_ms", "bound+KV ms", ".1f"),
                ("eager_over_bound_kv", "eager/bound+KV", ".2f"),
                ("gemm_floor_ms", "GEMM floor ms", ".1f"),
                ("eager_over_roofline", "eager/roofline", ".2f"),
                ("cell_read_gb_s", "cell GB/s", ".1f"),
                ("eager_over_cell_bound", "eager/cell bound", ".2f"),
                ("eager_over_cell_bound_kv", "eager/cell bound+KV", ".2f"),
            ],
        )
    )
    out = evalkit.Output(a, __file__, evalkit.cells_tag(a.dtype, b=a.batch))
    out.write(rows, bandwidth=bw, command=" ".join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
