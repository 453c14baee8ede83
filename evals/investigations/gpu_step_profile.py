"""Where a decode step's time goes on a GPU: kernel launch latency, transformers' own decode
(sdpa + DynamicCache) against our paged `TorchRunner` step, and a torch.profiler table of one
paged step. Random-weight Qwen3 models built from their configs (`tokenrouter_sdk.random_models`).

Run:
    python3 evals/investigations/gpu_step_profile.py --out OUTDIR         # CUDA, qwen3-0.6b and qwen3-8b
    python3 evals/investigations/gpu_step_profile.py --out /tmp/p --device cpu --shrink

Writes ``<out>/gpu_step_profile_<device>.json`` and ``.csv`` (one row per model: step ms of
transformers' decode and of the paged step at batch 1 and 8); the profiler table is printed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (after one warm-up), synchronised."""
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def launch_latency(dev) -> float:
    import torch

    x = torch.zeros(16, device=dev)
    n = 2000

    def run():
        for _ in range(n):
            x.add_(1)

    return timed(run, dev, 3) / n


def hf_decode(model, dev, b: int, ctx: int, vocab: int, steps: int = 10) -> float:
    """transformers' own decode step (sdpa, DynamicCache), batch b, context ctx: median seconds."""
    import torch
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, vocab, (b, ctx), device=dev)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        ts = []
        for _ in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            sync(dev)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:])


def paged(model, dev, b: int, ctx: int, vocab: int, steps: int = 10, profile: bool = False):
    """Our paged decode step (`TorchRunner.forward`), batch b, context ctx: median seconds of the
    step and of building its batch, and (``profile``) a torch.profiler table of one step."""
    import torch

    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.engine.core.block_allocator import blocks_of
    from tokenrouter_sdk.engine.runner import SeqInput

    r = TorchRunner(model, max_kv_tokens=(b + 1) * (ctx + steps + 8))
    tables = [[] for _ in range(b)]
    lens = [ctx] * b
    for t in tables:
        blocks_of(r).ensure(t, ctx + steps + 4)
    first = [SeqInput(torch.randint(0, vocab, (ctx,)).tolist(), 0, tables[i]) for i in range(b)]
    r.forward(first)

    def seqs():
        return [SeqInput([7], lens[i], tables[i]) for i in range(b)]

    ts, tb = [], []
    for _ in range(steps):
        s = seqs()
        sync(dev)
        t0 = time.perf_counter()
        r._batch(s)
        tb.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r.forward(s)
        sync(dev)
        ts.append(time.perf_counter() - t0)
        lens[:] = [n + 1 for n in lens]
    table = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with prof(activities=acts) as p:
            r.forward(seqs())
            sync(dev)
        table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
    r.pool.release()
    return statistics.median(ts[2:]), statistics.median(tb[2:]), table


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shrink", action="store_true", help="tiny shapes (a CPU rehearsal of the flow)")
    args = ap.parse_args(argv)

    import torch

    from tokenrouter_sdk.random_models import random_model

    dev = torch.device(args.device)
    res, rows = {"launch_us": launch_latency(dev) * 1e6}, []
    print(f"kernel launch (x.add_ loop): {res['launch_us']:.1f} us each", flush=True)
    shrink = (
        dict(
            num_hidden_layers=2,
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=2048,
            eos_token_id=2000,
            bos_token_id=None,
        )
        if args.shrink
        else {}
    )
    dtype = torch.float32 if args.shrink else torch.bfloat16
    vocab = 2048 if args.shrink else 151936
    for name in ("qwen3-0.6b", "qwen3-8b"):
        m = random_model(name, dtype=dtype, device=args.device, **shrink)
        row = {}
        for b in (1, 8):
            row[f"hf_b{b}_ms"] = hf_decode(m, dev, b, 128, vocab) * 1e3
        for b in (1, 8):
            step, batch, table = paged(m, dev, b, 128, vocab, profile=(b == 8))
            row[f"paged_b{b}_ms"], row[f"paged_b{b}_batch_build_ms"] = step * 1e3, batch * 1e3
            if table:
                print(f"--- {name} paged decode step, batch 8, context 128: torch.profiler by self CPU time")
                print(table, flush=True)
        res[name] = row
        rows.append({"model": name, **row})
        print(name, json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
        del m
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    tag = args.device.replace(":", "") + ("_shrink" if args.shrink else "")
    evalkit.Output(args, __file__, tag).write(rows, launch_us=res["launch_us"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
