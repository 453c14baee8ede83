"""``tokenrouter distill``: rebuild the packaged pair's self-draft small model from scratch (CPU)."""

from __future__ import annotations

from ..train.self_draft.config import DistillConfig


def add_parser(sub) -> None:
    """Register ``tokenrouter distill`` on an argparse subparsers object."""
    d = DistillConfig()
    p = sub.add_parser("distill", help="rebuild the packaged pair's self-draft small model from scratch (CPU, ~45 min)")
    p.add_argument(
        "--out",
        default=None,
        help="output .safetensors (default: a file in the cache folder; the "
        "packaged one is tokenrouter_sdk/assets/smollm2_self_draft.safetensors)",
    )
    p.add_argument("--k", type=int, default=d.k, help=f"shared layers of the large model (default {d.k})")
    p.add_argument("--m", type=int, default=d.m, help=f"trained layers on top (default {d.m})")
    p.add_argument("--prompts", type=int, default=d.train_prompts, help="synthetic training prompts")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="teacher continuation length")
    p.add_argument("--seconds", type=float, default=d.seconds, help="training wall-clock budget (s)")
    p.add_argument("--epochs", type=int, default=d.max_epochs, help="at most this many epochs")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.set_defaults(fn=run)


def run(args) -> int:
    """Run `distill` from parsed arguments on the packaged large model; prints the measurements."""
    import json

    import torch

    from ..benchmarks import load as load_benchmark_rows
    from ..models import cache_dir, load_model, smollm2_folder
    from ..train.self_draft.pipeline import distill

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or str(cache_dir() / "self_draft" / "smollm2_self_draft.safetensors")
    cfg = DistillConfig(
        k=args.k,
        m=args.m,
        train_prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        seconds=args.seconds,
        max_epochs=args.epochs,
        lr=args.lr,
    )
    large, tok = load_model(smollm2_folder())
    qs = load_benchmark_rows("gsm8k", cfg.gsm8k_heldout).questions
    meta = distill(large, tok, out, cfg, gsm8k_questions=qs)
    print(json.dumps({k: meta[k] for k in ("agreement", "step_time", "times_s", "total_s")}, indent=1))
    print(f"wrote {out} (+ .json)")
    return 0
