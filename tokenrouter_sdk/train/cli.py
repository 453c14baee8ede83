"""``tokenrouter train {r2r,citer,co_llm,query}``: train a router head on the packaged CPU pair
(`Router.default`, the self-draft pair unless ``--small-layers``) from GSM8K test questions without
the 128 held-out ones, and save it (and its JSON record) under ``--out``."""

from __future__ import annotations

import json

KINDS = ("r2r", "citer", "co_llm", "query")


def add_parser(sub) -> None:
    """Add the ``train`` subcommand to an argparse subparsers object."""
    t = sub.add_parser("train", help="train a router head (r2r, citer, co_llm, query) on the packaged CPU pair")
    t.add_argument("kind", choices=KINDS)
    t.add_argument("--data", help="JSONL with id, question, answer, meta.solution (default: the GSM8K test set shipped "
                                  "with the package; the 128 held-out questions gsm8k-test-0000..0127 are always "
                                  "excluded)")
    t.add_argument("--limit", type=int, default=64, help="training questions (default 64)")
    t.add_argument("--out", default="heads", help="output folder (default heads/)")
    t.add_argument("--max-new-tokens", type=int, default=96, help="response / answer length, tokens (r2r, query)")
    t.add_argument("--epochs", type=int, default=None, help="training epochs (default: the pipeline's)")
    t.add_argument("--small-layers", type=int, default=None,
                   help="small = plain truncation to this many layers (default: the packaged self-draft, "
                        "Router.default()'s pair)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=run)


def run(args) -> int:
    """Run one pipeline from parsed arguments; prints the head path, threshold and metrics."""
    from tokenrouter_sdk import Router
    from tokenrouter_sdk import train as T
    kw = {"data": args.data, "limit": args.limit, "out": args.out, "seed": args.seed}
    if args.epochs is not None:
        kw["epochs"] = args.epochs
    if args.kind in ("r2r", "query"):
        kw["max_new_tokens"] = args.max_new_tokens
    fn = {"r2r": T.train_r2r, "citer": T.train_citer, "co_llm": T.train_co_llm, "query": T.train_query}[args.kind]
    from tokenrouter_sdk.models import describe_default_pair
    print(describe_default_pair(args.small_layers), flush=True)
    extra = {} if args.small_layers is None else {"small_layers": args.small_layers}
    with Router.default(processes=False, **extra) as router:
        res = fn(router, **kw)
    print(f"head      {res.head_path}\nrecord    {res.meta_path}\nthreshold {res.threshold:.6g}")
    print(json.dumps({k: v for k, v in res.metrics.items()}, indent=1, default=str))
    return 0
