"""Engine vs `transformers.generate` on the packaged CPU model: committed tokens/s of the same
work, and how much of a step the engine spends outside the model forward.

What runs, in ONE process on the same weights (SmolLM2-135M-Instruct, fp32) and the same prompts
(the first N GSM8K questions in the GSM8K template of `tokenrouter_sdk.benchmarks`, chat-templated):
  engine    Router({"large": large}, LargeOnly()), greedy, ignore_eos=True, max_new_tokens=M;
            concurrency c = at most c requests in flight (router.generate(..., concurrency=c)).
  generate  large.generate on left-padded batches of c prompts (attention mask, do_sample=False,
            min_new_tokens = max_new_tokens = M), with attention switched to "sdpa" for it (the
            Router's paged attention ignores padding masks outside the engine) and back after.
Both sides write exactly N*M tokens. One warm-up of each side, then the repeats interleaved
(engine, generate, engine, generate, ...) so load noise hits both; the table shows medians.

How to read the table:
  engine tok/s     router.metrics().throughput_tok_s: committed tokens / (first admit .. last finish)
  generate tok/s   generated tokens / wall time of all its batches (tokenization excluded both sides)
  ratio            engine / generate (> 1: the engine is faster)
  ovh step         1 - forward_fraction of the large model: time of a step spent outside the model
                   forward (batch building, sampling, routing, commit events) / step time
  ovh e2e          (window - sum of forward_s) / window over the trace: also counts idle gaps
                   between steps (scheduler loop, thread hand-offs, admission at concurrency 1)
  paired ratio     median over repeats of engine/generate within one repeat (the pair ran back to
                   back, so it is less sensitive to load from other processes than the ratio of medians)
  CPU-time ratio   median of generate CPU s / engine CPU s (process time, all threads; > 1: the engine
                   used less CPU for the same tokens; robust to other processes taking the cores)
Targets (printed as PASS/FAIL): engine >= generate at c=8, and ovh step < 15% at c=8.

Run:
    .venv/bin/python evals/throughput/engine_vs_generate.py --concurrency 1 8 --max-new-tokens 64 --repeats 3

Writes ``<out>/engine_vs_generate_<cells>.json`` (every repeat and the medians) and ``.csv`` (the
medians, one line per concurrency).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def load_questions(n: int) -> list[str]:
    from tokenrouter_sdk.benchmarks import load as load_benchmark_rows

    data = load_benchmark_rows("gsm8k", n)
    print(f"prompts: first {len(data)} GSM8K questions from {data.source}")
    return data.prompts


def set_attn(model, name: str) -> None:
    """Switch the model (and every module config it holds) to attention ``name``."""
    from tokenrouter_sdk.backends.attention import ATTN_NAME, use_paged_attention

    if name == ATTN_NAME:
        use_paged_attention(model)
        return
    model.set_attn_implementation(name)
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", name) != name:
            cfg._attn_implementation = name


def run_engine(router, ids, c, m):
    from tokenrouter_sdk.engine.messages import Admitted, Finished, StepDone

    steps: list = []  # every StepDone, including those after the call's last Finished
    remove = router.engine.add_observer(lambda ev: steps.append(ev) if isinstance(ev, StepDone) else None)
    cpu = time.process_time()
    t = time.perf_counter()
    try:
        outs = router.generate(ids, concurrency=c, max_new_tokens=m, ignore_eos=True)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        t0 = min(ev.t for ev in outs.trace if isinstance(ev, Admitted))
        t1 = max(ev.t for ev in outs.trace if isinstance(ev, Finished))
        # the step that wrote the last tokens reports its StepDone after the Finished
        deadline = time.perf_counter() + 2.0
        while time.perf_counter() < deadline and not any(s.t_end >= t1 for s in list(steps)):
            time.sleep(0.005)
    finally:
        remove()
    met = router.metrics()
    steps = [s for s in steps if t0 <= s.t_start <= t1]
    fwd = sum(s.forward_s for s in steps)
    pm = met.per_model["large"]
    toks = sum(len(o.token_ids) for o in outs)
    assert toks == len(ids) * m, f"engine wrote {toks} tokens, expected {len(ids) * m}"
    return dict(
        tok_s=met.throughput_tok_s,
        wall_tok_s=toks / wall,
        tokens=toks,
        wall_s=wall,
        cpu_s=cpu,
        ovh_step=1 - pm.forward_fraction,
        ovh_e2e=(t1 - t0 - fwd) / (t1 - t0),
        mean_step_ms=pm.mean_step_s * 1e3,
        mean_fwd_ms=fwd / len(steps) * 1e3,
        steps=len(steps),
        busy=pm.busy_fraction,
    ), [o.token_ids for o in outs]


def run_generate(model, ids, c, m, pad_id):
    import torch

    from tokenrouter_sdk.backends.attention import ATTN_NAME

    set_attn(model, "sdpa")
    try:
        toks, outs, t, cpu = 0, [], time.perf_counter(), time.process_time()
        for i in range(0, len(ids), c):
            chunk = ids[i : i + c]
            w = max(map(len, chunk))
            inp = torch.tensor([[pad_id] * (w - len(x)) + x for x in chunk])
            mask = torch.tensor([[0] * (w - len(x)) + [1] * len(x) for x in chunk])
            with torch.inference_mode():
                out = model.generate(
                    input_ids=inp,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=m,
                    min_new_tokens=m,
                    pad_token_id=pad_id,
                )[:, w:]
            toks += out.numel()
            outs.extend(out.tolist())
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    finally:
        set_attn(model, ATTN_NAME)
    assert toks == len(ids) * m, f"generate wrote {toks} tokens, expected {len(ids) * m}"
    return dict(tok_s=toks / wall, tokens=toks, wall_s=wall, cpu_s=cpu), outs


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests in flight (default 1 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens written per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    ap.add_argument("--prompts", type=int, default=8, help="number of prompts (GSM8K questions, default 8)")
    a = ap.parse_args(argv)

    import torch

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.models import default_pair
    from tokenrouter_sdk.policies import LargeOnly

    if a.threads:
        torch.set_num_threads(a.threads)
    print(evalkit.environment(), flush=True)
    large, _, tok = default_pair()
    qs = load_questions(a.prompts)
    ids = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in qs
    ]
    print(
        f"{len(ids)} prompts, {min(map(len, ids))}-{max(map(len, ids))} tokens; "
        f"{a.max_new_tokens} new tokens each; concurrency {a.concurrency}; repeats {a.repeats}"
    )
    router = Router({"large": large}, LargeOnly(), tokenizer=tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cmax = max(a.concurrency)
    run_engine(router, ids, cmax, 8)  # warm-up
    run_generate(large, ids, cmax, 8, pad)
    res = {c: {"engine": [], "generate": []} for c in a.concurrency}
    same = {}
    for r in range(a.repeats):
        for c in a.concurrency:
            e, eo = run_engine(router, ids, c, a.max_new_tokens)
            g, go = run_generate(large, ids, c, a.max_new_tokens, pad)
            res[c]["engine"].append(e)
            res[c]["generate"].append(g)
            same[c] = sum(x == y for x, y in zip(eo, go))
            e["paired_ratio"], e["cpu_ratio"] = e["tok_s"] / g["tok_s"], g["cpu_s"] / e["cpu_s"]
            print(
                f"  rep {r} c={c}: engine {e['tok_s']:6.1f} tok/s (wall {e['wall_tok_s']:.1f}, step "
                f"{e['mean_step_ms']:.1f} ms, fwd {e['mean_fwd_ms']:.1f} ms, {e['steps']} steps, ovh step "
                f"{e['ovh_step']:.1%} e2e {e['ovh_e2e']:.1%}) | generate {g['tok_s']:6.1f} tok/s | ratio "
                f"{e['paired_ratio']:.2f}, by CPU {e['cpu_ratio']:.2f} | load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    router.close()
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    summary = {}
    print(
        f"\ntorch threads {torch.get_num_threads()}, loadavg {tuple(round(x, 2) for x in os.getloadavg())}; "
        f"medians of {a.repeats}; greedy outputs identical engine vs generate (last rep): "
        + ", ".join(f"c={c}: {same[c]}/{len(ids)}" for c in a.concurrency)
    )
    print(
        f"{'concurrency':>11} | {'engine tok/s':>12} | {'generate tok/s':>14} | {'ratio':>5} | "
        f"engine overhead (1 - fwd/step) | e2e (1 - fwd/wall) | paired ratio | CPU-time ratio"
    )
    for c in a.concurrency:
        e, g = res[c]["engine"], res[c]["generate"]
        s = dict(
            engine_tok_s=med(e, "tok_s"),
            generate_tok_s=med(g, "tok_s"),
            ovh_step=med(e, "ovh_step"),
            ovh_e2e=med(e, "ovh_e2e"),
            paired_ratio=med(e, "paired_ratio"),
            cpu_ratio=med(e, "cpu_ratio"),
        )
        s["ratio"] = s["engine_tok_s"] / s["generate_tok_s"]
        summary[c] = s
        print(
            f"{c:>11} | {s['engine_tok_s']:>12.1f} | {s['generate_tok_s']:>14.1f} | {s['ratio']:>5.2f} | "
            f"{s['ovh_step']:>30.1%} | {s['ovh_e2e']:>17.1%} | {s['paired_ratio']:>12.2f} | "
            f"{s['cpu_ratio']:>14.2f}"
        )
    bars = {}
    if 8 in summary:
        bars = {
            "engine >= generate at c=8": summary[8]["ratio"] >= 1,
            "overhead < 15% at c=8": summary[8]["ovh_step"] < 0.15,
        }
        for name, ok in bars.items():
            print(f"{name}: {'PASS' if ok else 'FAIL'}")
    out = evalkit.Output(a, __file__, evalkit.cells_tag(c=a.concurrency, t=a.max_new_tokens, n=a.prompts))
    out.write([{"concurrency": c, **s} for c, s in summary.items()], runs=res, identical=same, bars=bars)
    return 0


if __name__ == "__main__":
    sys.exit(main())
