"""Our runner against vLLM's, side by side in one run on this machine: the large model alone and
routed (RandomRouting, 30% of the steps to the large model), at concurrency 1 and 8, for the
packaged pair (SmolLM2-135M-Instruct and its self-draft, float32) and the Qwen2.5-Coder pair
(0.5B / 1.5B, `pair_dtype`). Scheduling, handoffs and KV retention are the engine's either way;
only who runs the model step changes (``ModelSpec(source, runner="vllm")``, both models on it).

Each cell runs once per runner; with ``--together`` the two runners' Routers are open at once and
alternate cell by cell (a change in the machine's load hits both alike; twice the memory),
otherwise one runner's cells run, its Router closes, then the other's. A cell is committed tokens
/ wall seconds over ``2 * c`` GSM8K
prompts at concurrency ``c``, after an unmeasured 8-token warm-up of the same batch on the same Router.
The other processes' share of the CPUs is recorded per cell (`tokenrouter_sdk.eval.machine`).

Needs ``pip install 'tokenrouter-sdk[vllm]'``; the Qwen pair takes about 4 GB per runner (8 GB
with ``--together``), so on a shared machine it runs under a lock. Writes
``<out>/engine_runners_<cells>.json/.csv``.

Run:
    flock /tmp/heavy.lock .venv/bin/python evals/throughput/engine_runners.py --max-new-tokens 64
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

POLICIES = ("large_only", "random30")


def packaged(tmp: Path, runner: str) -> dict:
    """The packaged pair on ``runner``: ours takes the loaded models; vLLM loads the large
    model's folder and the self-draft written to ``tmp``."""
    import torch

    from tokenrouter_sdk.models import default_pair, smollm2_folder
    from tokenrouter_sdk.placement import ModelSpec

    large, small, tok = default_pair(dtype=torch.float32)
    if runner == "ours":
        return {"small": (small, tok), "large": (large, tok)}
    folder = tmp / "smollm2-self-draft"
    if not (folder / "config.json").exists():
        small.save_pretrained(folder)
        tok.save_pretrained(folder)
    return {
        "small": ModelSpec(str(folder), dtype="float32", runner="vllm"),
        "large": ModelSpec(str(smollm2_folder()), dtype="float32", runner="vllm"),
    }


def coder(tmp: Path, runner: str) -> dict:
    from tokenrouter_sdk.pairs import pair_models
    from tokenrouter_sdk.placement import ModelSpec

    specs = pair_models("qwen2.5-coder")
    if runner == "ours":
        return specs
    return {n: ModelSpec(s.source, device=s.device, dtype=s.dtype, runner="vllm") for n, s in specs.items()}


PAIRS = {"packaged": packaged, "qwen2.5-coder": coder}


def policy_of(name: str):
    from tokenrouter_sdk.policies import LargeOnly, RandomRouting

    return LargeOnly() if name == "large_only" else RandomRouting(p=0.3, seed=0)


def measure(router, prompts: list, policy: str, c: int, new: int) -> dict:
    from tokenrouter_sdk import SamplingParams
    from tokenrouter_sdk.eval.machine import CpuWindow

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    batch = [prompts[i % len(prompts)] for i in range(2 * c)]
    router.generate(
        batch, max_new_tokens=8, ignore_eos=True, policy=policy_of(policy), concurrency=c, timeout=1800
    )  # warm-up: the same batch shapes, unmeasured
    with CpuWindow() as w:
        outs = router.generate(batch, sampling=params, policy=policy_of(policy), concurrency=c, timeout=1800)
    tokens = sum(len(o.token_ids) for o in outs)
    large = sum(m == "large" for o in outs for m in o.token_models) / max(1, tokens)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    return {
        "tokens": tokens,
        "wall_s": round(w.wall_s, 3),
        "tok_s": round(tokens / w.wall_s, 2),
        "large_fraction": round(large, 3),
        **{k: v for k, v in w.record().items() if k != "cpus"},
    }


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runners", nargs="+", default=["ours", "vllm"], choices=["ours", "vllm"])
    ap.add_argument(
        "--together",
        action="store_true",
        help="keep both runners' Routers open and alternate them cell by cell (twice the memory)",
    )
    args = ap.parse_args(argv)
    out = evalkit.Output(args, __file__, evalkit.cells_tag(*args.pairs, c=args.concurrency, t=args.max_new_tokens))

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.eval.machine import load_summary

    prompts = load_prompts("gsm8k", 16)
    rows = []
    with tempfile.TemporaryDirectory(prefix="engine-runners-") as tmp:
        for pair in args.pairs:
            cells = [(p, c) for p in POLICIES for c in args.concurrency]
            groups = [args.runners] if args.together else [[r] for r in args.runners]
            for group in groups:
                routers = {}
                try:
                    for r in group:
                        t = time.perf_counter()
                        routers[r] = Router(PAIRS[pair](Path(tmp), r), policy_of("large_only"), max_kv_tokens=8192)
                        print(f"{pair}: {r} Router started in {time.perf_counter() - t:.1f} s", flush=True)
                    for pol, c in cells:
                        for r in group:
                            row = {
                                "pair": pair,
                                "runner": r,
                                "policy": pol,
                                "concurrency": c,
                                "max_new_tokens": args.max_new_tokens,
                                **measure(routers[r], prompts, pol, c, args.max_new_tokens),
                            }
                            rows.append(row)
                            print(
                                f"{pair} {pol:10s} c={c:<2d} {r:5s} {row['tok_s']:8.2f} tok/s  large "
                                f"{row['large_fraction']:.2f}  other CPU share {row['other_share'] or 0:.2f}  "
                                f"load {row['load_1m']:.2f}",
                                flush=True,
                            )
                finally:
                    for router in routers.values():
                        router.close()
    ratios = []
    for pair in args.pairs:
        for pol in POLICIES:
            for c in args.concurrency:
                got = {
                    r["runner"]: r["tok_s"]
                    for r in rows
                    if (r["pair"], r["policy"], r["concurrency"]) == (pair, pol, c)
                }
                if {"ours", "vllm"} <= set(got):
                    ratios.append(
                        {
                            "pair": pair,
                            "policy": pol,
                            "concurrency": c,
                            "ours_tok_s": got["ours"],
                            "vllm_tok_s": got["vllm"],
                            "ours_over_vllm": round(got["ours"] / got["vllm"], 2),
                        }
                    )
    print(
        evalkit.table(
            ratios,
            [
                ("pair", "pair", "s"),
                ("policy", "policy", "s"),
                ("concurrency", "c", "d"),
                ("ours_tok_s", "ours tok/s", ".2f"),
                ("vllm_tok_s", "vLLM tok/s", ".2f"),
                ("ours_over_vllm", "ours/vLLM", ".2f"),
            ],
        )
    )
    if ratios:
        print(f"median ours/vLLM: {statistics.median(r['ours_over_vllm'] for r in ratios):.2f}")
    out.write(rows, ratios=ratios, load=load_summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
