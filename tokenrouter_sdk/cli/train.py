"""``tokenrouter train {r2r,citer,co_llm,query}``: train a router head on a pair (the packaged CPU
pair, `Router.default`, the self-draft pair unless ``--small-layers``; or your own with ``--model
small=SOURCE --model large=SOURCE``, ``--device``, ``--dtype``) from GSM8K *train* questions
(shipped with the package; ``--data gsm8k`` takes GSM8K test without its 128 held-out questions),
give it a default threshold that sends ``--large-fraction`` of the tokens to the large model
(default 0.7, what the packaged heads use: at 0.25 the docs' table shows the heads no better
than random routing; calibrated in the engine on ``--calibrate`` training prompts, in the policy
``--policy`` names, e.g. ``co_llm:compose=true``), and save it (and its JSON record: the ids it
trained, validated and was calibrated on) under ``--out``, or with ``--package`` where the
policies look for their default head (``tokenrouter_sdk/assets/smollm2_<kind>_head.pt``,
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
POLICY_OF = {"r2r": "r2r", "citer": "citer", "co_llm": "co_llm", "query": "query_router"}  # kind -> registry name
THRESHOLD_OF = {"r2r": "tau", "citer": "tau", "co_llm": "eta", "query": "threshold"}
DEFAULT_LARGE_FRACTION = 0.7  # the packaged heads' (docs/train.md: at 0.25 they are no better than random)
# flags that only some pipelines read: dest -> (the kinds, its default)
KIND_FLAGS = {
    "branches": (("r2r",), 8),
    "branch_tokens": (("r2r",), 32),
    "unverified": (("r2r",), "drop"),
    "rollouts": (("citer",), 4),
    "reference": (("citer", "co_llm", "query"), "gold"),
    "cache": (("r2r", "citer", "co_llm"), None),
    "concurrency": (("r2r", "citer", "co_llm", "query"), 16),
    "calibrate": (KINDS, 16),
    "calibrate_tokens": (("r2r", "citer", "co_llm"), 128),
    "max_new_tokens": (("r2r", "query", "citer", "co_llm"), 96),
}


def add_parser(sub) -> None:
    """Add the ``train`` subcommand to an argparse subparsers object."""
    from .common import add_model_arguments

    t = sub.add_parser(
        "train",
        help="train a router head (r2r, citer, co_llm, query) on the packaged CPU pair or "
        "your own (--model small=... --model large=...)",
    )
    t.add_argument("kind", choices=KINDS)
    t.add_argument(
        "--data",
        help="a benchmark name or a JSONL with id, question, answer, meta.solution (default: "
        "gsm8k_train, GSM8K's train split shipped with the package; gsm8k = GSM8K test, "
        "whose 128 held-out questions gsm8k-test-0000..0127 are always excluded)",
    )
    t.add_argument("--limit", type=int, default=64, help="training questions (default 64)")
    t.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the dataset's first N rows (GSM8K train: start at gsm8k-train-<N>) (default 0)",
    )
    t.add_argument("--out", default="heads", help="output folder (default heads/)")
    t.add_argument(
        "--package",
        action="store_true",
        help="also write the head (float16) and its record where the package looks for the pair's default "
        "head (tokenrouter_sdk/assets/<pair>_<kind>_head.*); the float32 head stays in --out",
    )
    t.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="response / answer length, tokens (r2r, query; citer and co_llm with --reference large)",
    )
    t.add_argument("--branches", type=int, default=None, help="r2r: verified differing positions per response (8)")
    t.add_argument(
        "--branch-tokens", type=int, default=None, help="r2r: bound of each branch continuation, tokens (32)"
    )
    t.add_argument(
        "--unverified",
        choices=("drop", "divergent"),
        default=None,
        help="r2r: differing positions beyond --branches are dropped (default) or kept as divergent",
    )
    t.add_argument("--rollouts", type=int, default=None, help="citer: rollouts per example (4)")
    t.add_argument(
        "--reference",
        choices=("gold", "large"),
        default=None,
        help="query: label = the small answer is correct (gold) or agrees with the large model's (large); "
        "citer, co_llm: teacher-force the gold solutions or the large model's greedy responses",
    )
    t.add_argument(
        "--cache",
        default=None,
        help="folder where the large model's responses are kept and reused across pipelines (r2r, citer, "
        "co_llm; default: none)",
    )
    t.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight in its generations (r2r, citer, co_llm, query; default 16)",
    )
    t.add_argument("--epochs", type=int, default=None, help="training epochs (default: the pipeline's)")
    t.add_argument(
        "--large-fraction",
        type=float,
        default=DEFAULT_LARGE_FRACTION,
        help="the default threshold sends this share of the committed tokens (query: of the prompts) to "
        f"the large model (default {DEFAULT_LARGE_FRACTION}, the packaged heads'; below about half "
        "large the heads of the packaged pair are no better than random routing, docs/train.md)",
    )
    t.add_argument(
        "--policy",
        default=None,
        metavar="SPEC",
        help="the policy the head is calibrated in: the kind's registry name (r2r, citer, co_llm) with "
        "fixed arguments, e.g. co_llm:compose=true (the head and its threshold come from training; "
        "not for query, whose threshold its pipeline picks)",
    )
    t.add_argument(
        "--calibrate",
        type=int,
        default=None,
        help="training prompts the default threshold is calibrated on, in the engine (query: recorded "
        "only, its pipeline picks the threshold; default 16)",
    )
    t.add_argument(
        "--calibrate-tokens",
        type=int,
        default=None,
        help="r2r, citer, co_llm: tokens per calibration answer (default 128)",
    )
    add_model_arguments(t)
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(fn=run)


def resolve_kind_flags(args, prog: str = "tokenrouter train") -> None:
    """Fill the kind-specific flags left out with their defaults (`KIND_FLAGS`), in place.

    Raises:
        SystemExit: a flag given for a kind whose pipeline does not read it (names both), e.g.
            ``--branches`` with ``citer``, or ``--max-new-tokens`` with citer/co_llm on gold
            solutions.
    """
    for dest, (kinds, default) in KIND_FLAGS.items():
        value = getattr(args, dest, None)
        used = args.kind in kinds
        if dest == "max_new_tokens" and args.kind in ("citer", "co_llm"):
            used = (args.reference or "gold") == "large"
        if value is not None and not used:
            flag = "--" + dest.replace("_", "-")
            why = (
                "teacher-forces the gold solutions (give --reference large)"
                if dest == "max_new_tokens"
                else f"does not use it (it applies to {', '.join(kinds)})"
            )
            raise SystemExit(f"{prog}: {flag} does not apply to {args.kind}: its pipeline {why}")
        if value is None:
            setattr(args, dest, default)
    args.kind_flags_resolved = True


def pipeline_kwargs(args) -> dict:
    """The keyword arguments of ``train_<kind>`` that the parsed options give (kind-specific
    flags left out get their defaults, `resolve_kind_flags`)."""
    if not getattr(args, "kind_flags_resolved", False):
        resolve_kind_flags(args)
    kw = {"data": args.data, "limit": args.limit, "offset": args.offset, "out": args.out, "seed": args.seed}
    if args.epochs is not None:
        kw["epochs"] = args.epochs
    if args.kind in ("r2r", "query") or args.reference == "large":
        kw["max_new_tokens"] = args.max_new_tokens
    if args.kind in ("r2r", "citer", "co_llm"):
        kw["cache"] = args.cache
    kw["concurrency"] = args.concurrency
    if args.kind in ("citer", "co_llm"):
        kw["reference"] = args.reference
    if args.kind == "r2r":
        kw |= {"max_branches": args.branches, "branch_tokens": args.branch_tokens, "unverified": args.unverified}
    if args.kind == "citer":
        kw["max_rollouts"] = args.rollouts
    if args.kind == "query":
        kw |= {"large_share": args.large_fraction, "reference": args.reference}
    return kw


def policy_kwargs(args, prog: str = "tokenrouter train") -> dict:
    """The fixed arguments of ``--policy`` for calibration (typed by the registry).

    Raises:
        SystemExit: a spec naming another kind's policy, the head or the threshold, an unknown
            argument, or any spec with ``query``.
    """
    if args.policy is None:
        return {}
    from ..policies.registry import PolicySpecError, builtin_registry

    if args.kind == "query":
        raise SystemExit(
            f"{prog}: --policy: the query head's threshold is chosen by its pipeline, not calibrated in a "
            f"policy; --policy does not apply to query"
        )
    try:
        entry, kwargs = builtin_registry().resolve(args.policy)
    except PolicySpecError as e:
        raise SystemExit(f"{prog}: --policy: {e}") from None
    if entry.name != POLICY_OF[args.kind]:
        raise SystemExit(
            f"{prog}: --policy names '{entry.name}', but a {args.kind} head runs in '{POLICY_OF[args.kind]}'"
        )
    fixed = sorted({"head", THRESHOLD_OF[args.kind]} & set(kwargs))
    if fixed:
        raise SystemExit(
            f"{prog}: --policy: {fixed} come from training (the head and its calibrated threshold); "
            f"give the policy's other arguments only"
        )
    return kwargs


def _gsm8k(data: str) -> bool:
    """Whether ``--data`` names a shipped GSM8K split (train or test)."""
    from tokenrouter_sdk.benchmarks import ALIASES

    key = ALIASES.get(str(data).lower(), str(data).lower())
    return key in ("gsm8k", "gsm8k_train")


def run(args) -> int:
    """Run one pipeline from parsed arguments, calibrate the default threshold and write the head;
    prints the head path, threshold and metrics."""
    import torch

    from tokenrouter_sdk import train as T
    from tokenrouter_sdk.policies.r2r import EMBEDDING_SOURCES

    from ..train.data import DEFAULT_DATA, load_examples
    from ..train.package import finalize, packaged_path
    from .common import build_router, describe_pair, pair_of

    prog = "tokenrouter train"
    if args.package and (
        args.small_layers is not None or args.model or (args.data is not None and not _gsm8k(args.data))
    ):
        raise SystemExit(
            "tokenrouter train: --package writes the default head of a named pair (--pair) on GSM8K "
            "(--data gsm8k_train, the default, or gsm8k); drop --small-layers/--model/--data or use --out"
        )
    pair = pair_of(args, prog)
    if not 0 < args.large_fraction < 1:
        raise SystemExit(f"{prog}: --large-fraction must be in (0, 1), got {args.large_fraction}")
    extra_policy = policy_kwargs(args, prog)
    if not getattr(args, "kind_flags_resolved", False):
        resolve_kind_flags(args, prog)
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = pipeline_kwargs(args)
    fn = {"r2r": T.train_r2r, "citer": T.train_citer, "co_llm": T.train_co_llm, "query": T.train_query}[args.kind]
    print(describe_pair(args), flush=True)
    print(
        f"data: {args.data or DEFAULT_DATA} (questions from row {args.offset}; the record lists the ids trained, "
        f"validated and calibrated on)",
        flush=True,
    )
    with build_router(args, prog, processes=False) as router:
        res = fn(router, **kw)  # the trained head (float32) stays in --out
        calib = load_examples(args.data, args.calibrate, offset=args.offset)
        dest = packaged_path(args.kind, pair).parent if args.package else None
        name = packaged_path(args.kind, pair).stem if args.package else None
        head, record, thr = finalize(
            res,
            router,
            target=args.large_fraction,
            calib_prompts=calib,
            max_new_tokens=args.calibrate_tokens,
            dest=dest,
            name=name,
            dtype=torch.float16 if args.package else None,
            embedding=router.models[list(router.models)[0]],
            config=(
                {"embedding_source": EMBEDDING_SOURCES[pair]}
                if args.kind == "r2r" and pair in EMBEDDING_SOURCES
                else None
            ),
            policy_kwargs=extra_policy,
        )
    print(
        f"head      {head}\nrecord    {record}\nthreshold {thr:.6g} (default; large fraction target "
        f"{args.large_fraction})"
    )
    print(json.dumps({k: v for k, v in res.metrics.items()}, indent=1, default=str))
    return 0
