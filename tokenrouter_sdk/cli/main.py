"""The ``tokenrouter`` command line.

``tokenrouter demo`` runs the first GSM8K questions (shipped with the package, in the GSM8K
template of `tokenrouter_sdk.benchmarks`) on a named pair (``--pair``, default ``qwen2.5-coder``:
Qwen2.5-Coder-0.5B-Instruct -> -1.5B-Instruct; ``smollm2``: SmolLM2-135M and its self-draft)
three times, with the large model alone, the small model alone and routed by R-Stitch
(`tokenrouter_sdk.demo`), prints each routed answer with the tokens of each model told apart
(colours on a terminal, ``[S:...]`` / ``[L:...]`` markers otherwise) beside the large-only
answer, then one comparison table (committed tokens/s and its ratio to large-only, large share,
hop rate, answers agreeing with large-only, answers equal to the reference), the step
accounting of each run and the routed run's metrics table.

The demo's operating point is the pair's (`tokenrouter_sdk.pairs.Pair.rstitch`): R-Stitch hands
small -> large above a normalised entropy ``tau`` and back once the large model's is at most
``tau_back`` (qwen2.5-coder: 0.05 and 0.02; smollm2: 0.3 and 0.02), one request at a time
(``--concurrency 1``) and ``prefill_peers`` on. A threshold does not carry across pairs: tau 0.3
routes about a third of the tokens to the large model on the SmolLM2 pair and 0.1% on the Qwen
pair, whose small model is far more certain. One request at a time because on a CPU a decode
step costs nearly the same for 2 or 8 requests (and a 1-request step is the cheapest, a
matrix-vector product): at concurrency 8 routing splits each model's batch, so the pair spends
more CPU per committed token than the large model alone; one request at a time, a routed token
costs less than a large-only one (the Qwen pair's small step is about a third of the large's).
The table's last column (committed tokens per CPU second of the sub-servers) is what a shared
machine cannot skew. ``tokenrouter info`` prints versions,
torch threads and the cache folder. ``tokenrouter eval`` sweeps a policy's threshold on a
benchmark (quality at hop rate; `tokenrouter_sdk.cli.eval`). ``demo`` and ``eval`` default to the
Qwen2.5-Coder pair, ``bench``, ``train`` and ``serve`` to the SmolLM2 pair (``--pair`` on each;
``--small-layers K``: the plain truncation of SmolLM2 to K layers), and each prints one
``pair: ...`` line naming it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..benchmarks import load, load_prompts

COLORS = ["\033[36m", "\033[33m", "\033[35m", "\033[32m"]  # cyan (small), yellow (large), ...
RESET = "\033[0m"
JSONL_SUFFIXES = (".jsonl", ".gz", ".json")


def model_label(models: list[str]) -> dict[str, str]:
    """Marker letter per model: its initial, upper-case (the whole name if initials collide)."""
    letters = [m[:1].upper() for m in models]
    return dict(zip(models, letters if len(set(letters)) == len(letters) else models))


def format_output(out, tokenizer, models: list[str], color: bool) -> str:
    """The answer text with each run of tokens of one model coloured (``color``) or wrapped as
    ``[S:...]``. Runs are decoded as differences of prefix decodes, so leading spaces and
    characters split across runs survive; special tokens (EOS) are skipped."""
    labels, parts, ids, prev, segs = model_label(models), [], [], "", out.segments()
    for k, (model, run) in enumerate(segs):
        ids += run
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if k < len(segs) - 1:  # a character cut between runs goes to the run that completes it
            text = text.rstrip("\ufffd")
        piece = text[len(prev) :] if text.startswith(prev) else tokenizer.decode(run, skip_special_tokens=True)
        prev = text
        if not piece:
            continue
        if color:
            parts.append(f"{COLORS[models.index(model) % len(COLORS)]}{piece}{RESET}")
        else:
            parts.append(f"[{labels[model]}:{piece}]")
    return "".join(parts)


def demo_inputs(
    prompt: list[str] | None, data: str | None, n: int
) -> tuple[list[str], list[str], str, str, list[str] | None]:
    """`demo_prompts` plus the answer kind of the prompts (``"math"`` or ``"choice"``, from the
    benchmark; math for ``--prompt`` and text files) and the reference answers (None for
    ``--prompt`` and text files)."""
    if prompt:
        return list(prompt), list(prompt), "--prompt", "math", None
    if data is not None and Path(data).is_file() and Path(data).suffix not in JSONL_SUFFIXES:
        prompts = load_prompts(data, n)
        return prompts, prompts, data, "math", None
    bench = load(data or "gsm8k", n)
    refs = list(bench.answers) if all(a not in (None, "") for a in bench.answers) else None
    return bench.prompts, bench.questions, f"{bench.spec.name} ({bench.source})", bench.spec.kind, refs


def demo_prompts(prompt: list[str] | None, data: str | None, n: int) -> tuple[list[str], list[str], str]:
    """What the demo routes: ``(prompts, what to print above each answer, source)``.

    ``prompt`` (the ``--prompt`` strings) wins; else ``data`` (``--data``): a benchmark name, a
    JSONL file (its questions in the template of the benchmark its name contains; both read by
    `tokenrouter_sdk.benchmarks`) or a text file with one prompt per line; else the first ``n``
    GSM8K questions shipped with the package, in the GSM8K template.

    Raises:
        FileNotFoundError: a ``data`` path that does not exist.
        ValueError: an unknown benchmark name, ``n < 1`` or a malformed JSONL file.
    """
    return demo_inputs(prompt, data, n)[:3]  # type: ignore[return-value]


def cmd_demo(args) -> int:
    """Run the prompts large-only, small-only and routed; print the routed answers (coloured or
    marked) beside the large-only answers and the references, the comparison table, the step
    accounting and the routed run's metrics."""
    import torch
    from transformers.utils import logging as hf_logging

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.policies import RandomRouting, RStitch

    from ..demo import format_accounting, format_comparison, run_comparison
    from ..models import ModelLoadError
    from ..pairs import get_pair

    hf_logging.disable_progress_bar()
    pair = get_pair(args.pair)
    try:
        prompts, shown, source, kind, refs = demo_inputs(args.prompt, args.data, args.num)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"tokenrouter demo: {e}")
    if args.seed is not None and args.temperature == 0:
        sys.exit(
            "tokenrouter demo: --seed seeds sampling, which --temperature 0 (greedy) does not do: give "
            "--temperature > 0 or drop --seed"
        )
    if args.small_layers is not None and pair.small is not None:
        sys.exit(
            f"tokenrouter demo: --small-layers truncates SmolLM2 (--pair smollm2); pair {pair.name} has its "
            f"own small model"
        )
    color = sys.stdout.isatty() and not args.no_color
    tau = pair.rstitch[0] if args.tau is None else args.tau
    tau_back = pair.rstitch[1] if args.tau_back is None else args.tau_back
    if args.small_layers is None:
        print(pair.describe())
    else:
        from ..models import describe_default_pair

        print(describe_default_pair(args.small_layers))
    t0 = time.perf_counter()
    policy = RStitch(tau=tau, tau_back=tau_back)
    try:
        router = Router.default(
            policy=policy,
            pair=pair.name,
            small_layers=args.small_layers,
            prefill_peers=not args.no_prefill_peers,
            prefix_cache=not args.no_prefix_cache,
            compile={"off": False, "wait": "wait", "background": "background"}[args.compile],
            model_impl=args.model_impl,
            kernels=args.kernels or "wait",
        )
    except (ModelLoadError, ImportError) as e:
        sys.exit(f"tokenrouter demo: {type(e).__name__}: {e}")
    with router:
        models = list(router.models)
        print(f"models : {', '.join(models)} (loaded in {time.perf_counter() - t0:.1f} s)")
        print(f"policy : {policy!r}")
        threads = router.child_threads or torch.get_num_threads()
        print(
            f"run    : {len(prompts)} prompt{'s' * (len(prompts) != 1)} from {source}, "
            f"max_new_tokens={args.max_new_tokens}, concurrency={args.concurrency}, "
            f"prefill_peers={not args.no_prefill_peers}, torch threads per model={threads}"
        )
        if color:
            print("legend : " + "  ".join(f"{COLORS[i % len(COLORS)]}{m}{RESET}" for i, m in enumerate(models)))
        else:
            print("legend : " + "  ".join(f"[{c}:...] = {m}" for m, c in model_label(models).items()))
        router.generate(prompts[:2], max_new_tokens=4, policy=RandomRouting(p=0.5, seed=0))  # warm both models up
        t1 = time.perf_counter()
        runs = run_comparison(
            router,
            prompts,
            policy,
            kind=kind,
            baselines=not args.no_baselines,
            references=refs,
            max_new_tokens=args.max_new_tokens,
            concurrency=args.concurrency,
            temperature=args.temperature,
            seed=args.seed,
            on_run=lambda r: print(f"ran    : {r.name} in {r.metrics.wall_s:.1f} s", flush=True),
        )
        gen_s = time.perf_counter() - t1
        routed, large = runs[-1], (runs[0] if not args.no_baselines else None)
        for i, out in enumerate(routed.outputs):
            large_frac = out.token_models.count(models[-1]) / max(1, len(out.token_ids))
            print(f"\n=== {i + 1}/{len(prompts)}: {shown[i]}")
            print(format_output(out, router.tokenizer, models, color) if out.ok else f"ERROR: {out.error}")
            print(
                f"--- finish={out.finish_reason} tokens={len(out.token_ids)} hops={out.hops} "
                f"large_fraction={large_frac:.2f} latency={out.latency_s or 0:.1f}s"
            )
            line = f"--- answer={routed.answers[i]}"
            if refs is not None:
                line += f" ({'right' if routed.correct[i] else 'wrong'}; reference {refs[i]})"
            if large is not None:
                line += f" large-only answer={large.answers[i]}" + (
                    f" ({'right' if large.correct[i] else 'wrong'})" if refs is not None else ""
                )
            print(line)
        print(
            f"\n=== comparison ({gen_s:.1f} s generation, {time.perf_counter() - t0:.1f} s total; same prompts "
            f"and Router; correct = final answers equal to the references; tok/s = committed tokens / wall time)"
        )
        print(format_comparison(runs))
        print("\n=== step accounting (forward time: pure decode steps vs steps that also fed a prefill or extend)")
        print(format_accounting(runs))
        print("\n=== metrics of the routed run")
        print(routed.metrics.table())
    return 0 if all(o.ok for r in runs for o in r.outputs) else 1


def cmd_info(args) -> int:
    """Print versions, torch threads, the cache folder, the data file found and the choices
    measured on this machine (`tokenrouter_sdk.backends.autotune`: GEMM paths and the few-row
    kernel's prefetch;
    `tokenrouter_sdk.backends.attention.kernel_choice`: the CPU kernel's extend limit and where it
    scores 16 keys at a time)."""
    import platform

    import torch
    import transformers

    import tokenrouter_sdk
    from tokenrouter_sdk.models import cache_dir
    from tokenrouter_sdk.pairs import PAIRS, cpu_has_bfloat16, pair_dtype

    print(f"tokenrouter_sdk {tokenrouter_sdk.__version__} ({Path(tokenrouter_sdk.__file__).parent})")
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(
        f"torch threads {torch.get_num_threads()}, cuda {torch.cuda.is_available()}, "
        f"native bfloat16 {cpu_has_bfloat16()}"
    )
    print(f"cache dir {cache_dir()}")
    for name, pair in sorted(PAIRS.items()):
        folders = ["smollm2-135m-instruct"] if pair.small is None else [pair.small.folder, pair.large.folder]
        done = all((cache_dir() / f / "config.json").exists() for f in folders)
        dtype = "float32" if pair.small is None else str(pair_dtype()).removeprefix("torch.")
        print(
            f"pair {name}: {'converted' if done else 'not converted yet (fetched at first use)'}, runs in {dtype}"
            f" ({pair.summary})"
        )
    try:
        data = load("gsm8k", 1).source
    except (FileNotFoundError, ValueError) as e:
        data = f"not available ({e})"
    print(f"demo data gsm8k from {data}")
    from ..backends.attention.kernel_choice import describe
    from ..backends.autotune import report

    for line in report(describers=(describe,)):
        print(line)
    return 0


def cmd_bench(args) -> int:
    """The side-by-side throughput benchmark (see `tokenrouter_sdk.bench`)."""
    from ..bench import CsvLog, environment, format_accounting, format_table, run_bench, write_html
    from .common import build_policy, describe_pair, fail, load_models, per_model, policy_registry, tp_of

    prog = "tokenrouter bench"
    ints = lambda xs: tuple(int(x) for x in xs)  # noqa: E731
    registry, own = policy_registry(args, prog)
    if args.policy and args.policies is not None:
        raise fail(prog, "give the routed policies with --policy (repeatable) or --policies, not both")
    policies = args.policy or args.policies or ([own] if own else ["random10", "random30", "rstitch"])
    for pol in policies:  # every spec is checked before anything loads
        if not (pol.startswith("random") and pol[len("random") :].isdigit()):
            build_policy(registry, pol, prog, transport="thread" if args.backend == "sim" else args.transport)
    if args.thresholds != "auto" and "delayed" not in args.modes:
        raise fail(prog, f"--thresholds apply to the delayed cells, and --modes {' '.join(args.modes)} has none")
    if args.random_pair is None and args.prompt_tokens is not None:
        raise fail(prog, "--prompt-tokens sets the prompts of --random-pair; the other pairs take --data")
    if args.random_pair is not None and args.data is not None:
        raise fail(prog, "--random-pair runs token-id prompts (--prompt-tokens); --data does not apply")
    kw: dict = {}
    if args.backend == "sim":
        from ..backends.sim_runner import LatencyModel
        from ..models import tiny_tokenizer

        given = [
            f
            for f, v in (
                ("--model", args.model),
                ("--device", args.device),
                ("--dtype", args.dtype),
                ("--random-pair", args.random_pair),
                ("--small-layers", args.small_layers),
                ("--transport", None if args.transport == "auto" else args.transport),
                ("--cuda-graphs", args.cuda_graphs or None),
            )
            if v is not None
        ]
        if given:
            raise fail(prog, f"--backend sim runs latency models: {', '.join(given)} do not apply")
        models, tok = (
            {
                "small": LatencyModel({1: 0.024, 8: 0.039, 16: 0.051}),
                "large": LatencyModel({1: 0.064, 8: 0.110, 16: 0.158}),
            },
            tiny_tokenizer(),
        )
        prompts = [[5 + i % 200] * 40 for i in range(64)]
        kw = {"backend": "sim"}
    elif args.random_pair:
        from ..placement import DeviceError, resolve_device, resolve_dtype
        from ..random_models import id_tokenizer, random_model, random_prompts

        names = args.random_pair.split(",")
        if len(names) != 2:
            raise fail(prog, f"--random-pair takes SMALL,LARGE (e.g. qwen3-0.6b,qwen3-8b), got {args.random_pair!r}")
        if args.model or args.small_layers is not None:
            raise fail(prog, "--random-pair builds its own models: --model and --small-layers do not apply")
        dev = per_model(args.device or "cuda", ["small", "large"], "--device", prog)
        dt = per_model(args.dtype or "bfloat16", ["small", "large"], "--dtype", prog)
        pick = lambda v, n: v[n] if isinstance(v, dict) else v  # noqa: E731
        try:
            models = {
                n: random_model(name, dtype=resolve_dtype(pick(dt, n)), device=resolve_device(pick(dev, n)), seed=i)
                for i, (n, name) in enumerate(zip(("small", "large"), names))
            }
        except (DeviceError, ValueError) as e:
            raise fail(prog, f"{type(e).__name__}: {e}") from None
        tok = id_tokenizer()
        prompts = random_prompts(64, args.prompt_tokens or 128, seed=0)
    else:
        print(describe_pair(args))
        models, tok = load_models(args, prog)
        try:
            prompts = load_prompts(args.data or "gsm8k", 64)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"tokenrouter bench: --data: {e}") from None
    if args.backend != "sim":
        if args.max_kv_tokens:
            kw["max_kv_tokens"] = args.max_kv_tokens
        if args.transport != "auto":
            kw["processes"] = args.transport == "process"
        if args.cuda_graphs:
            kw["cuda_graphs"] = True
    if args.no_prefix_cache:
        kw["prefix_cache"] = False
    tp = tp_of(args, list(models), prog)
    if tp:
        kw["tp"] = tp
    if args.model_impl and args.backend != "sim":
        kw["model_impl"] = args.model_impl
    if args.kernels and args.backend != "sim":
        kw["kernels"] = args.kernels
    if getattr(args, "allow_unknown_attention", False) and args.backend != "sim":
        kw["allow_unknown_attention"] = True
    print(environment())
    deadline = time.monotonic() + 60 * args.time_budget_min if args.time_budget_min else None
    log = CsvLog(args.out + ".csv")
    cells = run_bench(
        models,
        tok,
        prompts,
        policies=policies,
        modes=args.modes,
        concurrency=ints(args.concurrency),
        max_new_tokens=ints(args.max_new_tokens),
        baselines=not args.no_baselines,
        thresholds=args.thresholds,
        deadline=deadline,
        on_cell=log,
        warmup_tokens=args.warmup_tokens,
        max_routers=args.max_routers,
        registry=registry,
        **kw,
    )
    print(format_table(cells))
    print("\nwhere the time went (per cell and model):")
    print(format_accounting(cells))
    log.rewrite(cells)  # with the final ratios
    html = write_html(cells, args.out + ".html")
    print(f"wrote {args.out}.csv" + (f" and {args.out}.html" if html else " (no plotly: no HTML chart)"))
    if any(c.failed for c in cells):
        print(f"{prog}: requests failed in {sum(bool(c.failed) for c in cells)} cell(s): exit 1", file=sys.stderr)
        return 1
    return 0


def add_bench_arguments(b: argparse.ArgumentParser, *, out: bool = True) -> argparse.ArgumentParser:
    """The ``bench`` options (shared by the subcommand and ``evals/throughput/side_by_side.py``);
    ``out=False`` leaves out ``--out`` (the caller sets ``args.out``, an output prefix)."""
    b.add_argument("--backend", choices=["torch", "sim"], default="torch")
    from .common import add_model_arguments, add_policy_arguments, add_prefix_cache_flag

    add_policy_arguments(
        b,
        default=None,
        repeat=True,
        what="a routed policy to bench (repeat for several; default random10 random30 rstitch)",
    )
    b.add_argument(
        "--policies",
        nargs="+",
        default=None,
        help="the routed policies, in one flag: random<PCT> (RandomRouting at that large fraction) or "
        "registry specs (default random10 random30 rstitch)",
    )
    b.add_argument("--modes", nargs="+", default=["sync", "model_sync", "async", "delayed"])
    b.add_argument("--concurrency", nargs="+", default=["1", "4", "8", "16"])
    b.add_argument("--max-new-tokens", nargs="+", default=["256"])
    b.add_argument("--thresholds", default="auto", help="delayed thresholds: auto (planner) or small=8,large=4")
    b.add_argument("--no-baselines", action="store_true", help="skip retain_kv=False, large-only, small-only")
    add_model_arguments(b)
    b.add_argument(
        "--data",
        help="prompts: a benchmark name, a JSONL with 'question' or a text file with one "
        "prompt per line (default: the first 64 GSM8K questions, shipped with the package)",
    )
    b.add_argument(
        "--random-pair",
        metavar="SMALL,LARGE",
        help="random-weight models built from configs, e.g. qwen3-0.6b,qwen3-8b (token-id prompts; "
        "--device default cuda, --dtype default bfloat16)",
    )
    b.add_argument("--prompt-tokens", type=int, default=None, help="prompt length with --random-pair (default 128)")
    b.add_argument(
        "--max-kv-tokens",
        type=int,
        default=None,
        help="KV pool per model, tokens (default: large enough that KV never limits a cell)",
    )
    b.add_argument(
        "--transport",
        choices=["auto", "process", "thread"],
        default="auto",
        help="sub-servers in processes or threads (default: processes for two torch models)",
    )
    b.add_argument(
        "--time-budget-min",
        type=float,
        default=None,
        help="start no cell after this many minutes (cells so far are reported)",
    )
    b.add_argument(
        "--warmup-tokens",
        type=int,
        default=0,
        help="unmeasured warm-up generation per new Router (tokens; use on GPUs)",
    )
    b.add_argument(
        "--max-routers",
        type=int,
        default=None,
        help="Routers open at once (default: all; 1 for large pairs on a small GPU)",
    )
    b.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="serve decode steps from captured CUDA graphs (torch backend on a GPU)",
    )
    add_prefix_cache_flag(b)
    if out:
        b.add_argument("--out", default="bench", help="output prefix for .csv and .html")
    return b


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with the ``demo``, ``bench``, ``info`` and ``eval`` subcommands."""
    p = argparse.ArgumentParser(prog="tokenrouter", description="Token-level routing between a small and a large LM.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser(
        "demo",
        help="GSM8K questions on the packaged CPU pair: large-only, small-only and "
        "routed by R-Stitch, compared in one table",
    )
    d.add_argument(
        "--data",
        help="a benchmark name (gsm8k, math500, aime24, amc23, commonsenseqa), a JSONL with a "
        "'question' field, or a text file with one prompt per line (default: the GSM8K "
        "test set shipped with the package)",
    )
    d.add_argument("--prompt", action="append", help="a prompt (repeatable; overrides --data)")
    d.add_argument("-n", "--num", type=int, default=4, help="number of prompts from the data (default 4)")
    d.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    from ..pairs import DEFAULT_PAIR, PAIRS

    d.add_argument(
        "--pair",
        choices=sorted(PAIRS),
        default=DEFAULT_PAIR,
        help=f"the model pair (default {DEFAULT_PAIR}: Qwen2.5-Coder 0.5B -> 1.5B, fetched and converted "
        f"once, about 1.6 GB; smollm2: SmolLM2-135M and its self-draft, small and fast, near 0%% on "
        f"GSM8K)",
    )
    d.add_argument(
        "--tau",
        type=float,
        default=None,
        help="R-Stitch: the small model hands off above this normalised entropy (default: the pair's "
        "operating point, " + ", ".join(f"{n} {p.rstitch[0]}" for n, p in sorted(PAIRS.items())) + ")",
    )
    d.add_argument(
        "--tau-back",
        type=float,
        default=None,
        help="R-Stitch: the large model hands back at or below this normalised entropy (default: the "
        "pair's, " + ", ".join(f"{n} {p.rstitch[1]}" for n, p in sorted(PAIRS.items())) + ")",
    )
    d.add_argument(
        "--no-baselines", action="store_true", help="run the routed policy only (no large-only and small-only runs)"
    )
    d.add_argument(
        "--no-prefill-peers",
        action="store_true",
        help="prefill a prompt only on its entry model (a first handoff then prefills it on the peer)",
    )
    d.add_argument(
        "--small-layers",
        type=int,
        default=None,
        help="--pair smollm2: small = plain truncation to this many layers (default: the packaged self-draft)",
    )
    d.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests in flight (default 1: see the module docstring of tokenrouter_sdk.cli)",
    )
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--seed", type=int, default=None, help="per-request sampling seed (with --temperature > 0)")
    d.add_argument("--no-color", action="store_true", help="markers instead of colours")
    from .common import add_prefix_cache_flag

    add_prefix_cache_flag(d)
    d.add_argument(
        "--compile",
        choices=["off", "wait", "background"],
        default="off",
        help="compiled steps (EngineConfig.compile): off (eager), wait (the warm-up call waits for the "
        "compile: every timed step compiled) or background (default off)",
    )
    d.add_argument(
        "--model-impl",
        choices=["auto", "native", "transformers"],
        default="auto",
        help="the models' forward (EngineConfig.model_impl): auto (default: native, merged and prepacked "
        "projections), native, or transformers (the transformers forward, to compare)",
    )
    from .common import add_kernels_flag

    add_kernels_flag(d)
    d.set_defaults(fn=cmd_demo)
    b = sub.add_parser("bench", help="committed-token throughput: policies x modes x concurrency, side by side")
    add_bench_arguments(b)
    b.set_defaults(fn=cmd_bench)
    sub.add_parser("info", help="versions, threads, cache folder").set_defaults(fn=cmd_info)
    from .distill import add_parser as add_distill_parser

    add_distill_parser(sub)
    from .train import add_parser as add_train_parser

    add_train_parser(sub)
    from .eval import add_parser as add_eval_parser

    add_eval_parser(sub)
    from .serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenrouter`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[argv.index(args.cmd) + 1 :]  # the subcommand's own arguments (a sharded eval relaunches them)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
