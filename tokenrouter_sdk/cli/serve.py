"""``tokenrouter serve``: the OpenAI-compatible server from a shell.

    tokenrouter serve                                  # the packaged pair, R-Stitch, a free port
    tokenrouter serve --policy random:p=0.3 --port 8000
    tokenrouter serve --model small=path/to/small --model large=path/to/large --policy rstitch:tau=0.05
    tokenrouter serve --model small=Qwen/Qwen3-0.6B --model large=Qwen/Qwen3-8B --device small=cuda:0,large=cuda:1
    tokenrouter serve --policy-file my_policy.py:MyPolicy --mode delayed --thresholds small=8,large=4

This module imports neither FastAPI nor torch until the command runs.
"""

from __future__ import annotations

import argparse
import sys


def _thresholds(text: str | None):
    if text is None or text == "auto":
        return text
    out = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        try:
            out[name.strip()] = int(value)
        except ValueError:
            raise SystemExit(
                f"tokenrouter serve: --thresholds takes 'auto' or NAME=INT,... (e.g. small=8,large=4), got {text!r}"
            ) from None
        if not eq:
            raise SystemExit(f"tokenrouter serve: --thresholds item {item!r} is not NAME=INT")
    return out


def build(args):
    """The Router, app and listening socket of the parsed ``args``.

    Raises:
        SystemExit: a bad flag (names it and the fix).
    """
    try:
        from ..serve.app import create_app
        from ..serve.server import bind, url_of
    except ImportError as e:
        raise SystemExit(
            f"tokenrouter serve needs the serve extra: pip install 'tokenrouter-sdk[serve]' ({e})"
        ) from None
    from .common import build_policy, build_router, policy_registry

    prog = "tokenrouter serve"
    registry, own = policy_registry(args, prog)
    policy_label = (
        args.policy or own or DEFAULT_POLICY
    )  # the operator's class is the default unless --policy names another
    policy = build_policy(registry, policy_label, prog, transport=args.transport)
    if args.thresholds is not None and args.mode != "delayed":
        raise SystemExit(f"{prog}: --thresholds apply to --mode delayed (delayed batching), not --mode {args.mode}")
    if args.restart_limit < 0:
        raise SystemExit(
            f"{prog}: --restart-limit must be >= 0 (restarts per model; 0: never), got {args.restart_limit}"
        )
    settings = {"mode": args.mode}
    if args.thresholds is not None:
        settings["thresholds"] = _thresholds(args.thresholds)
    if args.max_kv_tokens:
        settings["max_kv_tokens"] = args.max_kv_tokens
    if args.kv_memory_fraction is not None:
        settings["kv_memory_fraction"] = args.kv_memory_fraction
    if args.max_concurrency:
        settings["max_concurrency"] = args.max_concurrency
    if args.transport != "auto":
        settings["processes"] = args.transport == "process"
    if args.no_prefix_cache:
        settings["prefix_cache"] = False
    if args.ray_address:
        if args.transport == "thread":
            raise SystemExit(
                f"{prog}: --ray-address runs the sub-servers in Ray actors; --transport thread cannot apply"
            )
        settings.pop("processes", None)
        settings["cluster"] = {"address": args.ray_address, "strategy": args.ray_strategy}
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise SystemExit(f"tokenrouter serve: {e}") from None
    try:
        router = build_router(args, prog, policy, **settings)
    except BaseException:
        sock.close()
        raise
    app = create_app(
        router,
        policy=policy,
        policy_label=policy_label,
        registry=registry,
        model_id=args.served_model_name,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        restart_limit=args.restart_limit,
    )
    return router, app, sock, url_of(sock)


DEFAULT_POLICY = "rstitch"


def cmd_serve(args) -> int:
    """Build the Router, print the URL, serve until Ctrl-C (or SIGTERM), then close the Router.

    Returns:
        0 after serving ends (Ctrl-C included: one line says so, no traceback); 130 when Ctrl-C
        came while the models were loading.
    """
    from ..serve.server import serve_forever

    try:
        router, app, sock, url = build(args)
    except KeyboardInterrupt:
        print("tokenrouter serve: interrupted while loading the models", file=sys.stderr, flush=True)
        return 130
    try:
        print(
            f"tokenrouter serve: {url} (OpenAI base_url {url}/v1); models {list(router.models)}; model id "
            f"'{args.served_model_name}'; policy {app.state.tr.policy_label}",
            flush=True,
        )
        serve_forever(app, sock, log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn shut down on Ctrl-C, then re-raised it
        print("tokenrouter serve: stopped (Ctrl-C)", file=sys.stderr, flush=True)
    finally:
        router.close()
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``sub`` (an argparse subparsers object)."""
    s = sub.add_parser(
        "serve",
        help="serve a Router over HTTP (OpenAI-compatible; needs the serve extra)",
        description="Serve token-level routing over HTTP: POST /v1/completions, /v1/chat/completions "
        "(stream: true for server-sent events), GET /v1/models, /health, /metrics.",
    )
    from .common import add_model_arguments, add_policy_arguments

    add_model_arguments(s)
    add_policy_arguments(
        s,
        default=None,
        what=f"the default policy of requests (default {DEFAULT_POLICY}; clients may "
        f"name any registry policy, and the --policy-file class)",
    )
    s.add_argument(
        "--mode",
        default="async",
        choices=["async", "delayed", "sync", "model_sync"],
        help="schedule mode (default async)",
    )
    s.add_argument("--thresholds", default=None, help="delayed batching thresholds: auto or NAME=INT,... ")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=0, help="TCP port (default 0: a free one, printed)")
    s.add_argument(
        "--served-model-name",
        default="tokenrouter",
        help="the model id clients send for routed generation (default tokenrouter)",
    )
    s.add_argument(
        "--max-kv-tokens",
        type=int,
        default=None,
        help="KV pool per model, tokens (default: sized by --kv-memory-fraction)",
    )
    s.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        help="share of the memory left after the weights that the KV pools of a device take (default 0.8 "
        "on a GPU; on the CPU 0.25 of the available RAM, at most 65,536 tokens per model)",
    )
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    s.add_argument(
        "--transport",
        choices=["auto", "process", "thread"],
        default="auto",
        help="sub-servers in processes or threads (default: processes for two torch models)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="host the sub-servers in Ray actors on this Ray cluster (auto, ray://HOST:10001 or a GCS "
        "address; pip install 'tokenrouter-sdk[ray]')",
    )
    s.add_argument(
        "--ray-strategy",
        default="PACK",
        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        help="placement of the sub-servers on the Ray cluster (default PACK)",
    )
    s.add_argument("--max-body-mb", type=float, default=4.0, help="larger request bodies get 413 (default 4 MiB)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument(
        "--restart-limit",
        type=int,
        default=3,
        metavar="N",
        help="restart a sub-server that died (its requests fail with the reason), at most N times per "
        "model, each logged (default 3; 0: never, /health answers 503 from the death on)",
    )
    from .common import add_prefix_cache_flag

    add_prefix_cache_flag(s)
    s.set_defaults(fn=cmd_serve)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenrouter")
    add_parser(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
