"""Every built-in policy on the packaged CPU pair, side by side in one run.

For each policy at its default parameters: realized hop rate, large fraction, discarded tokens
and committed-token throughput, on the first N GSM8K questions (GSM8K template of
`tokenrouter_sdk.benchmarks`, chat-templated, greedy) at concurrency C. Learned policies (CITER,
R2R, Co-LLM, query-level) get *random, untrained* heads here (trained heads: ``tokenrouter
train`` and evals/quality/trained_heads.py), so their routing shows the runtime's behaviour, not
the algorithm's quality; their thresholds are their published defaults.

Run:
    .venv/bin/python evals/quality/policy_table.py --num 16 --concurrency 8 --max-new-tokens 64

Writes ``<out>/policy_table_<cells>.csv`` and ``.json`` (one row per policy).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def policies(small, hidden: int) -> dict:
    """name -> (policy, note)."""
    from tokenrouter_sdk.policies import (CITER, R2R, CoLLM, GlimpRouter, LargeOnly, QueryRouter, R2RAleatoric,
                                          R2REntropy, RandomQueryRouting, RandomRouting, RStitch, SmallOnly)

    return {
        "SmallOnly": (SmallOnly(), ""),
        "LargeOnly": (LargeOnly(), ""),
        "RandomRouting(p=0.5)": (RandomRouting(), ""),
        "RStitch(tau=0.1)": (RStitch(), ""),
        "RStitch(max_prob, tau=0.5)": (RStitch(tau=0.5, signal="max_prob"), ""),
        "R2REntropy(0.45)": (R2REntropy(), ""),
        "R2RAleatoric(2.275)": (R2RAleatoric(), ""),
        "GlimpRouter(theta=1.0)": (GlimpRouter(), ""),
        "CITER(tau=0.95)": (CITER(CITER.random_head(hidden, seed=0)), "random head, untrained"),
        "CoLLM(eta=0.5)": (CoLLM(CoLLM.random_head(hidden, seed=0)), "random head, untrained"),
        "R2R(tau=0.5)": (R2R(R2R.random_head(hidden, seed=0), embedding=small), "random head, untrained"),
        "QueryRouter(0.5)": (QueryRouter(QueryRouter.random_head(hidden, seed=0)), "random head, untrained"),
        "RandomQueryRouting(p=0.5)": (RandomQueryRouting(), ""),
    }


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--num", type=int, default=16, help="GSM8K questions (default 16)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request at most (default 64)")
    ap.add_argument("--small-layers", type=int, default=None,
                    help="small = plain truncation to this many layers (default: the packaged self-draft)")
    ap.add_argument("--only", nargs="*", help="policy names to run (substring match)")
    args = ap.parse_args(argv)

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.models import default_pair, describe_default_pair

    prompts = load_prompts("gsm8k", args.num)
    print(describe_default_pair(args.small_layers))
    large, small, tok = default_pair(small_layers=args.small_layers)
    print(evalkit.environment(), f"{args.num} GSM8K questions, concurrency {args.concurrency}, "
          f"max_new_tokens {args.max_new_tokens}", flush=True)
    rows = []
    with Router({"small": small, "large": large}, tokenizer=tok) as router:
        router.generate(prompts[:2], max_new_tokens=4)  # warm-up
        for name, (pol, note) in policies(small, large.config.hidden_size).items():
            if args.only and not any(o in name for o in args.only):
                continue
            t = time.perf_counter()
            outs = router.generate(prompts, policy=pol, max_new_tokens=args.max_new_tokens,
                                   concurrency=args.concurrency)
            m = router.metrics()
            rows.append(dict(policy=name, hop_rate=m.hop_rate, large_fraction=m.large_fraction,
                             discarded=m.discarded_tokens, tokens=m.committed_tokens, tok_s=m.throughput_tok_s,
                             failed=m.failed, wall_s=time.perf_counter() - t, note=note))
            r = rows[-1]
            print(f"{name:<28} hop_rate {r['hop_rate']:.3f}  large_frac {r['large_fraction']:.3f}  "
                  f"discarded {r['discarded']:>4}  tokens {r['tokens']:>5}  {r['tok_s']:6.1f} tok/s  "
                  f"failed {r['failed']}  {note}", flush=True)
            assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    print(evalkit.table(rows, [("policy", "policy", "s"), ("hop_rate", "hop rate", ".3f"),
                               ("large_fraction", "large frac", ".3f"), ("discarded", "discarded", "d"),
                               ("tokens", "tokens", "d"), ("tok_s", "tok/s", ".1f"), ("failed", "failed", "d"),
                               ("note", "note", "s")]))
    evalkit.Output(args, __file__, evalkit.cells_tag(n=args.num, c=args.concurrency, t=args.max_new_tokens)).write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
