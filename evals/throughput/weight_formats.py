"""One decode step's projections of Qwen2.5-Coder-1.5B in each weight format a CPU could run:
float32, bfloat16, and torch's own weight-only int8 and int4 packed matmuls
(``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu`` with groups of 32).

Random weights of the model's shapes (28 layers: q/k/v merged 1536 -> 2048, o 1536 -> 1536,
gate/up merged 1536 -> 17920, down 8960 -> 1536); each format times the 28 layers' projections
at ``M`` rows (the tokens of a step), the formats interleaved over the repeats, and prints the
median milliseconds per step and the ratio to bfloat16. What the numbers leave out: attention,
norms and the LM head (the same for every format here), and the engine's fused C++ step, which
runs float32 and bfloat16 only.

Run:
    .venv/bin/python evals/throughput/weight_formats.py --rows 1 8 --repeats 7

Writes ``<out>/weight_formats_<cells>.json`` and ``.csv`` (one row per format and row count).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

LAYERS = 28
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # (out, in) per layer


def make(fmt: str, g):
    """One layer's weights in ``fmt`` and the function that applies one: (weights, apply)."""
    import torch

    ws = [torch.randn(o, i, generator=g) * 0.02 for o, i in SHAPES]
    if fmt in ("float32", "bfloat16"):
        dt = getattr(torch, fmt)
        return [w.to(dt) for w in ws], lambda x, w: torch.nn.functional.linear(x, w)
    if fmt == "int8":
        packed = []
        for w in ws:
            scale = w.abs().amax(dim=1) / 127
            packed.append(((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(torch.bfloat16)))
        return packed, lambda x, p: torch._weight_int8pack_mm(x, p[0], p[1])
    if fmt == "int4":
        group, packed = 32, []
        for w in ws:
            o, i = w.shape
            wg = w.reshape(o, i // group, group)
            lo, hi = wg.amin(-1), wg.amax(-1)
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(o, i)
            zero = lo + 8 * scale  # torch's int4 kernels dequantize (q - 8) * scale + zero
            sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            qp = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            packed.append((qp, sz))
        return packed, lambda x, p: torch._weight_int4pack_mm_for_cpu(x, p[0], group, p[1])
    raise ValueError(fmt)


def main() -> None:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    args = ap.parse_args()
    import torch

    g = torch.Generator().manual_seed(0)
    layers = {}
    for fmt in args.formats:
        try:
            layers[fmt] = make(fmt, g)
        except (RuntimeError, AttributeError) as e:
            print(f"{fmt}: not available here ({type(e).__name__}: {str(e)[:120]})")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {LAYERS} layers of projections per step")
    rows = []
    for m in args.rows:
        times = {f: [] for f in layers}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for fmt, (ws, apply) in layers.items():
                    x = torch.randn(m, 1536, generator=g).to(torch.float32 if fmt == "float32" else torch.bfloat16)
                    t = time.perf_counter()
                    for _layer in range(LAYERS):  # one layer's weights stand for each of the 28
                        a = apply(x, ws[0])
                        apply(x, ws[1])
                        gu = apply(x, ws[2])
                        h = gu[:, :8960] * a.mean()  # the down projection's input, [m, 8960]
                        apply(h, ws[3])
                    times[fmt].append(time.perf_counter() - t)
        base = statistics.median(times.get("bfloat16", [float("nan")]))
        for fmt, ts in times.items():
            med = statistics.median(ts)
            print(f"rows={m:<3d} {fmt:<9s} {1e3 * med:8.1f} ms/step  {med / base:5.2f}x bfloat16's time")
            rows.append(
                {
                    "rows": m,
                    "format": fmt,
                    "median_ms": 1e3 * med,
                    "vs_bfloat16": med / base,
                    "runs_ms": [1e3 * t for t in ts],
                }
            )
    evalkit.Output(args, __file__, evalkit.cells_tag(m=args.rows)).write(rows)


if __name__ == "__main__":
    main()
