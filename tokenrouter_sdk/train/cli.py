"""``tokenrouter train {r2r,citer,co_llm,query}``: train a router head on the packaged CPU pair
(`Router.default`, the self-draft pair unless ``--small-layers``) from GSM8K *train* questions
(shipped with the package; ``--data gsm8k`` takes GSM8K test without its 128 held-out questions),
give it a default threshold that sends ``--large-fraction`` of the tokens to the large model
(calibrated in the engine on ``--calibrate`` training prompts), and save it (and its JSON record:
the ids it trained, validated and was calibrated on) under ``--out``, or with ``--package`` where
the policies look for their default head (``tokenrouter_sdk/assets/smollm2_<kind>_head.pt``,
float16).

The packaged heads were trained on GSM8K *test* questions (before the train split shipped; their
records list the ids, and evaluations leave those questions out), with (``$C`` = ``--data gsm8k
--offset 556 --limit 300 --max-new-tokens 96 --concurrency 64 --cache .cache/train_responses
--threads 1 --large-fraction 0.7 --package``; their recorded commands predate ``--data gsm8k``,
the default then)::

    tokenrouter train r2r $C --branches 2 --branch-tokens 24 --unverified divergent
    tokenrouter train citer $C --reference large --rollouts 2
    tokenrouter train co_llm $C --reference large --epochs 0
    tokenrouter train query --data gsm8k --limit 128 --max-new-tokens 96 --reference large --threads 1 --package
"""

from __future__ import annotations

import json

KINDS = ("r2r", "citer", "co_llm", "query")


def add_parser(sub) -> None:
    """Add the ``train`` subcommand to an argparse subparsers object."""
    t = sub.add_parser("train", help="train a router head (r2r, citer, co_llm, query) on the packaged CPU pair")
    t.add_argument("kind", choices=KINDS)
    t.add_argument("--data", help="a benchmark name or a JSONL with id, question, answer, meta.solution (default: "
                                  "gsm8k_train, GSM8K's train split shipped with the package; gsm8k = GSM8K test, "
                                  "whose 128 held-out questions gsm8k-test-0000..0127 are always excluded)")
    t.add_argument("--limit", type=int, default=64, help="training questions (default 64)")
    t.add_argument("--offset", type=int, default=0,
                   help="skip the dataset's first N rows (GSM8K train: start at gsm8k-train-<N>) (default 0)")
    t.add_argument("--out", default="heads", help="output folder (default heads/)")
    t.add_argument("--package", action="store_true",
                   help="also write the head (float16) and its record where the package looks for the default head "
                        "(tokenrouter_sdk/assets/smollm2_<kind>_head.*); the float32 head stays in --out")
    t.add_argument("--max-new-tokens", type=int, default=96,
                   help="response / answer length, tokens (r2r, query; citer and co_llm with --reference large)")
    t.add_argument("--branches", type=int, default=8, help="r2r: verified differing positions per response")
    t.add_argument("--branch-tokens", type=int, default=32, help="r2r: bound of each branch continuation, tokens")
    t.add_argument("--unverified", choices=("drop", "divergent"), default="drop",
                   help="r2r: differing positions beyond --branches are dropped (default) or kept as divergent")
    t.add_argument("--rollouts", type=int, default=4, help="citer: rollouts per example")
    t.add_argument("--reference", choices=("gold", "large"), default="gold",
                   help="query: label = the small answer is correct (gold) or agrees with the large model's (large); "
                        "citer, co_llm: teacher-force the gold solutions or the large model's greedy responses")
    t.add_argument("--cache", default=None,
                   help="folder where the large model's responses are kept and reused across pipelines (r2r, citer, "
                        "co_llm; default: none)")
    t.add_argument("--concurrency", type=int, default=16, help="generation batch, requests in flight (default 16)")
    t.add_argument("--epochs", type=int, default=None, help="training epochs (default: the pipeline's)")
    t.add_argument("--large-fraction", type=float, default=0.25,
                   help="the default threshold sends this share of the committed tokens (query: of the prompts) to "
                        "the large model (default 0.25)")
    t.add_argument("--calibrate", type=int, default=16,
                   help="training prompts the default threshold is calibrated on, in the engine (default 16)")
    t.add_argument("--calibrate-tokens", type=int, default=128, help="tokens per calibration answer (default 128)")
    t.add_argument("--small-layers", type=int, default=None,
                   help="small = plain truncation to this many layers (default: the packaged self-draft, "
                        "Router.default()'s pair)")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=run)


def pipeline_kwargs(args) -> dict:
    """The keyword arguments of ``train_<kind>`` that the parsed options give."""
    kw = {"data": args.data, "limit": args.limit, "offset": args.offset, "out": args.out, "seed": args.seed}
    if args.epochs is not None:
        kw["epochs"] = args.epochs
    if args.kind in ("r2r", "query") or args.reference == "large":
        kw["max_new_tokens"] = args.max_new_tokens
    if args.kind in ("r2r", "citer", "co_llm"):
        kw |= {"cache": args.cache, "concurrency": args.concurrency}
    if args.kind in ("citer", "co_llm"):
        kw["reference"] = args.reference
    if args.kind == "r2r":
        kw |= {"max_branches": args.branches, "branch_tokens": args.branch_tokens, "unverified": args.unverified}
    if args.kind == "citer":
        kw["max_rollouts"] = args.rollouts
    if args.kind == "query":
        kw |= {"large_share": args.large_fraction, "reference": args.reference}
    return kw


def _gsm8k(data: str) -> bool:
    """Whether ``--data`` names a shipped GSM8K split (train or test)."""
    from tokenrouter_sdk.benchmarks import ALIASES
    key = ALIASES.get(str(data).lower(), str(data).lower())
    return key in ("gsm8k", "gsm8k_train")


def run(args) -> int:
    """Run one pipeline from parsed arguments, calibrate the default threshold and write the head;
    prints the head path, threshold and metrics."""
    import torch

    from tokenrouter_sdk import Router
    from tokenrouter_sdk import train as T
    from tokenrouter_sdk.models import describe_default_pair

    from .data import DEFAULT_DATA, load_examples
    from tokenrouter_sdk.policies.r2r import EMBEDDING_SOURCE

    from .package import finalize, packaged_path
    if args.package and (args.small_layers is not None or (args.data is not None and not _gsm8k(args.data))):
        raise SystemExit("tokenrouter train: --package writes the default head of Router.default()'s pair on GSM8K "
                         "(--data gsm8k_train, the default, or gsm8k); drop --small-layers/--data or use --out")
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = pipeline_kwargs(args)
    fn = {"r2r": T.train_r2r, "citer": T.train_citer, "co_llm": T.train_co_llm, "query": T.train_query}[args.kind]
    print(describe_default_pair(args.small_layers), flush=True)
    print(f"data: {args.data or DEFAULT_DATA} (questions from row {args.offset}; the record lists the ids trained, "
          f"validated and calibrated on)", flush=True)
    extra = {} if args.small_layers is None else {"small_layers": args.small_layers}
    with Router.default(processes=False, **extra) as router:
        res = fn(router, **kw)      # the trained head (float32) stays in --out
        calib = load_examples(args.data, args.calibrate, offset=args.offset)
        dest = packaged_path(args.kind).parent if args.package else None
        name = packaged_path(args.kind).stem if args.package else None
        head, record, thr = finalize(res, router, target=args.large_fraction, calib_prompts=calib,
                                     max_new_tokens=args.calibrate_tokens, dest=dest, name=name,
                                     dtype=torch.float16 if args.package else None,
                                     embedding=router.models[list(router.models)[0]],
                                     config=({"embedding_source": EMBEDDING_SOURCE} if args.kind == "r2r" else None))
    print(f"head      {head}\nrecord    {record}\nthreshold {thr:.6g} (default; large fraction target "
          f"{args.large_fraction})")
    print(json.dumps({k: v for k, v in res.metrics.items()}, indent=1, default=str))
    return 0
