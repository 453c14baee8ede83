"""The flags every model-running command shares (``eval``, ``bench``, ``train``, ``serve``): which
models (``--model NAME=SOURCE``, or the packaged pair with ``--small-layers``), where and in what
precision (``--device``, ``--dtype``: one for all, or ``NAME=VALUE,...`` per model), and the policy
(``--policy SPEC`` from the registry, ``--policy-file FILE.py:CLASS``). Each flag takes effect or
the command stops with a message naming the flag.

Imports nothing heavy at module level, so ``tokenrouter --help`` stays fast.
"""

from __future__ import annotations

import argparse

REGISTRY_HELP = (
    "a registry spec NAME[:k=v,...]: rstitch, random, large_only, small_only, single, r2r_entropy, "
    "r2r_aleatoric, glimprouter, ensemble, random_query, citer/r2r/co_llm/query_router (learned heads: "
    "head=PATH), e.g. rstitch:tau=0.3,tau_back=0.02 or r2r:head=heads/r2r_head.pt"
)


def add_model_arguments(
    p: argparse.ArgumentParser, *, small_layers: bool = True, pair_default: str = "smollm2"
) -> argparse.ArgumentParser:
    """``--pair``, ``--model``, ``--device``, ``--dtype``, ``--tp``, ``--runner``, ``--model-impl``,
    ``--kernels``, ``--allow-unknown-attention`` (and ``--small-layers`` for the SmolLM2 pair); ``pair_default``:
    the command's pair when neither ``--pair`` nor ``--model`` is given."""
    from ..pairs import PAIRS

    g = p.add_argument_group("models")
    g.add_argument(
        "--pair",
        choices=sorted(PAIRS),
        default=None,
        help=f"a named pair (default {pair_default}): qwen2.5-coder = Qwen2.5-Coder 0.5B (small) and 1.5B "
        f"(large), fetched and converted once (about 1.6 GB); smollm2 = SmolLM2-135M-Instruct and "
        f"its self-draft (small and fast, for quick looks: near 0%% on GSM8K)",
    )
    p.set_defaults(pair_default=pair_default)
    g.add_argument(
        "--model",
        action="append",
        metavar="NAME=SOURCE",
        help="a model: a folder (with config.json), a .gguf file or a hub id, smallest first; repeat for "
        "each (instead of --pair)",
    )
    g.add_argument(
        "--device",
        metavar="DEVICE|NAME=DEVICE,...",
        help="where the models run: cpu, cuda, cuda:1, ... for all, or per model, e.g. "
        "small=cuda:0,large=cuda:1 (default cpu)",
    )
    g.add_argument(
        "--dtype",
        metavar="DTYPE|NAME=DTYPE,...",
        help="precision: auto (the checkpoint's own), bfloat16, float16, float32, for all or per model "
        "(default: auto for --model sources, float32 for the smollm2 pair, bfloat16 for "
        "qwen2.5-coder where the CPU has it)",
    )
    g.add_argument(
        "--tp",
        metavar="NAME=RANKS,...",
        help="tensor-parallel ranks per model, e.g. large=2 (the model runs as that many processes, "
        "collectives by torch.distributed: gloo on the CPU, NCCL on CUDA with rank r on cuda:r); its "
        "heads and KV heads must divide by it; the packaged pair's large model takes large=3",
    )
    g.add_argument(
        "--runner",
        metavar="RUNNER|NAME=RUNNER,...",
        help="who runs each --model's forward: torch (default: ours), vllm (vLLM's model classes, "
        "kernels and paged KV; pip install 'tokenrouter-sdk[vllm]') or sglang, for all or per model, "
        "e.g. small=torch,large=vllm (see docs/own-models.md)",
    )
    g.add_argument(
        "--model-impl",
        choices=["auto", "native", "transformers"],
        default=None,
        help="the forward of torch models (EngineConfig.model_impl): auto (default: the native forward "
        "for Llama, Mistral, Qwen2 and Qwen3, with merged and, on a CPU, prepacked projections; "
        "transformers' for others), native, or transformers",
    )
    add_kernels_flag(g)
    add_attention_flag(g)
    if small_layers:
        g.add_argument(
            "--small-layers",
            type=int,
            default=None,
            help="smollm2 pair only: small = plain truncation of the large model to this many layers "
            "(default: the packaged self-draft)",
        )
    return p


def pair_of(args, prog: str) -> str | None:
    """The named pair the flags ask for (``--pair``, else the command's default), or None when
    ``--model`` names the models.

    Raises:
        SystemExit: ``--pair`` with ``--model``; ``--small-layers`` with a pair other than SmolLM2's.
    """
    from ..pairs import get_pair

    given = getattr(args, "pair", None)
    if getattr(args, "model", None):
        if given is not None:
            raise fail(prog, "give --pair or --model, not both")
        return None
    name = given or getattr(args, "pair_default", None) or "smollm2"
    if getattr(args, "small_layers", None) is not None and get_pair(name).small is not None:
        raise fail(prog, f"--small-layers truncates SmolLM2 (--pair smollm2); pair {name} has its own small model")
    return name


def add_policy_arguments(
    p: argparse.ArgumentParser, *, default: str | None = "rstitch", what: str = "the policy", repeat: bool = False
) -> argparse.ArgumentParser:
    """``--policy SPEC`` (repeatable with ``repeat``) and ``--policy-file FILE.py:CLASS``."""
    p.add_argument(
        "--policy",
        action="append" if repeat else "store",
        default=None if repeat else default,
        metavar="SPEC",
        help=f"{what}: {REGISTRY_HELP}" + (f" (default {default})" if default else ""),
    )
    p.add_argument(
        "--policy-file",
        metavar="FILE.py:CLASS",
        help="your own Policy subclass; registered under its class name (use it in --policy as CLASS or "
        "CLASS:k=v,...; it is the policy when --policy is not given)",
    )
    return p


def fail(prog: str, msg: str) -> SystemExit:
    return SystemExit(f"{prog}: {msg}")


def parse_models(args, prog: str) -> dict[str, str] | None:
    """``--model`` items as ``{name: source}`` in order, or None (the packaged pair).

    Raises:
        SystemExit: an item that is not NAME=SOURCE, a name given twice, or ``--small-layers``
            with ``--model``.
    """
    items = getattr(args, "model", None)
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        name, eq, src = item.partition("=")
        if not eq or not name.strip() or not src.strip():
            raise fail(prog, f"--model takes NAME=SOURCE (smallest first), got {item!r}")
        if name.strip() in out:
            raise fail(prog, f"--model: model name {name.strip()!r} given twice")
        out[name.strip()] = src.strip()
    if getattr(args, "small_layers", None) is not None:
        raise fail(prog, "--small-layers shapes the packaged pair's small model; it does not apply with --model")
    return out


def per_model(text: str | None, names: list[str] | None, flag: str, prog: str):
    """``--device``/``--dtype`` text as one value, or a dict name -> value for ``NAME=VALUE,...``.

    Raises:
        SystemExit: per-model values for the packaged pair, or naming a model not given.
    """
    if text is None or "=" not in text:
        return text
    out = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise fail(prog, f"{flag} takes one value or NAME=VALUE,... (e.g. small=cuda:0,large=cuda:1), got {text!r}")
        out[name.strip()] = value.strip()
    if names is None:
        raise fail(
            prog,
            f"{flag} per model needs --model: the packaged pair shares its first layers, so it takes one {flag[2:]}",
        )
    bad = sorted(set(out) - set(names))
    if bad:
        raise fail(prog, f"{flag} names {bad}, which are not models of --model ({names})")
    return out


def tp_of(args, names: list[str], prog: str) -> dict[str, int] | None:
    """``--tp NAME=RANKS,...`` as ``{name: ranks}`` (None when not given).

    Raises:
        SystemExit: not NAME=RANKS with RANKS a positive int, or naming a model not there.
    """
    text = getattr(args, "tp", None)
    if text is None:
        return None
    out = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        if not eq or not value.strip().isdigit() or int(value) < 1:
            raise fail(prog, f"--tp takes NAME=RANKS,... with RANKS a positive int (e.g. large=2), got {text!r}")
        out[name.strip()] = int(value)
    bad = sorted(set(out) - set(names))
    if bad:
        raise fail(prog, f"--tp names {bad}, which are not models here ({names})")
    return out


def model_specs(args, prog: str) -> dict | None:
    """``{name: ModelSpec}`` from ``--model``, ``--device`` and ``--dtype``, or None (the packaged
    pair)."""
    from ..placement import ModelSpec

    models = parse_models(args, prog)
    if models is None:
        return None
    dev = per_model(getattr(args, "device", None), list(models), "--device", prog)
    dt = per_model(getattr(args, "dtype", None), list(models), "--dtype", prog)
    tp = tp_of(args, list(models), prog) or {}
    run = per_model(getattr(args, "runner", None), list(models), "--runner", prog)
    pick = lambda v, n: v.get(n) if isinstance(v, dict) else v  # noqa: E731
    try:
        return {
            n: ModelSpec(src, pick(dev, n), pick(dt, n), tp=tp.get(n), runner=pick(run, n) or "torch")
            for n, src in models.items()
        }
    except ValueError as e:
        raise fail(prog, f"--runner: {e}") from None


def no_runner_flag(args, prog: str) -> None:
    """Refuse ``--runner`` without ``--model`` (a named pair runs on ours; give its folders with
    ``--model`` to run it on an engine).

    Raises:
        SystemExit: ``--runner`` other than torch without ``--model``.
    """
    if getattr(args, "runner", None) not in (None, "torch"):
        raise fail(
            prog,
            "--runner applies to --model sources (the engine loads each from its folder); a --pair "
            "runs on ours: give --model small=FOLDER --model large=FOLDER to run it elsewhere",
        )


def _errors():
    from ..models import ModelLoadError, TokenizerMismatchError
    from ..placement import DeviceError

    return (DeviceError, ModelLoadError, TokenizerMismatchError, ValueError, TypeError, OSError)


def add_kernels_flag(p) -> None:
    """``--kernels``: `EngineConfig.kernels` (default: not set, i.e. ``auto``)."""
    p.add_argument(
        "--kernels",
        choices=["auto", "wait", "off"],
        default=None,
        help="the engine's C++ CPU kernels (EngineConfig.kernels: in-place paged attention, fused norm, "
        "rotary and SiLU-gating ops): auto (default: built with the C++ compiler at first use, ATen "
        "ops until then), wait (wait for them; fail without a compiler) or off",
    )


def add_attention_flag(p) -> None:
    """``--allow-unknown-attention``: `EngineConfig.allow_unknown_attention`."""
    p.add_argument(
        "--allow-unknown-attention",
        action="store_true",
        help="run models whose attention uses a feature tokenrouter does not compute (an unknown "
        "attention keyword, chunked or bidirectional attention, a logit scaling after the LM head); "
        "refused by default, see docs/own-models.md",
    )


def build_router(args, prog: str, policy=None, **settings):
    """The `Router` the flags name: the packaged pair (``Router.default`` with ``--device``,
    ``--dtype``, ``--small-layers``) or the ``--model`` sources, each on its device and dtype.

    Raises:
        SystemExit: a bad flag or a model that cannot load (names it and why).
    """
    from ..pairs import get_pair
    from ..router import Router

    specs = model_specs(args, prog)
    if getattr(args, "model_impl", None):
        settings.setdefault("model_impl", args.model_impl)
    if getattr(args, "kernels", None):
        settings.setdefault("kernels", args.kernels)
    if getattr(args, "allow_unknown_attention", False):
        settings.setdefault("allow_unknown_attention", True)
    try:
        if specs is None:
            pair = pair_of(args, prog)
            names = ["small", "large"] if get_pair(pair).small is not None else None
            dev = per_model(getattr(args, "device", None), names, "--device", prog)
            dt = per_model(getattr(args, "dtype", None), names, "--dtype", prog)
            no_runner_flag(args, prog)
            tp = tp_of(args, ["small", "large"], prog)
            return Router.default(
                policy=policy,
                pair=pair,
                small_layers=getattr(args, "small_layers", None),
                device=dev,
                dtype=dt,
                **({"tp": tp} if tp else {}),
                **settings,
            )
        return Router(specs, policy, **settings)
    except _errors() as e:
        raise fail(prog, f"{type(e).__name__}: {e}") from None


def load_models(args, prog: str):
    """``(models, tokenizer)``: the models the flags name (name -> model, smallest first) and their
    shared tokenizer, for commands that build several Routers on them (``bench``): loaded here,
    or for a named pair with weight folders its `ModelSpec`s (each Router's sub-servers load them).

    Raises:
        SystemExit: as `build_router`.
    """
    from ..models import check_same_tokenizer, default_pair, load_model
    from ..pairs import get_pair, pair_models

    specs = model_specs(args, prog)
    try:
        if specs is None:
            pair = pair_of(args, prog)
            no_runner_flag(args, prog)
            if get_pair(pair).small is not None:  # each Router's sub-servers load the pair's folders
                from ..runner_setup import load_tokenizer

                dev = per_model(getattr(args, "device", None), ["small", "large"], "--device", prog)
                dt = per_model(getattr(args, "dtype", None), ["small", "large"], "--dtype", prog)
                specs = pair_models(pair, dtype=dt, device=dev or "cpu")
                return specs, load_tokenizer(specs["large"].source)
            else:
                per_model(getattr(args, "device", None), None, "--device", prog)
                per_model(getattr(args, "dtype", None), None, "--dtype", prog)
                large, small, tok = default_pair(
                    small_layers=getattr(args, "small_layers", None),
                    device=getattr(args, "device", None) or "cpu",
                    dtype=getattr(args, "dtype", None),
                )
                return {"small": small, "large": large}, tok
        models, toks = {}, {}
        for name, spec in specs.items():
            if spec.runner != "torch":
                raise fail(
                    prog,
                    f"--runner {spec.runner} for {name!r}: this command loads the models into this "
                    f"process, which only our torch runner does; use a command that builds a Router "
                    f"(run, serve, eval)",
                )
            dev, dt = spec.placed()
            models[name], toks[name] = load_model(spec.source, device=dev, dtype=dt)
        first = next(iter(toks))
        for name in toks:
            check_same_tokenizer(toks[first], first, toks[name], name)
        return models, toks[first]
    except _errors() as e:
        raise fail(prog, f"{type(e).__name__}: {e}") from None


def describe_pair(args) -> str:
    """The one ``pair: ...`` line the commands print: the packaged pair's description, or each
    ``--model`` source with its device and dtype."""
    models = getattr(args, "model", None)
    if not models:
        from ..models import describe_default_pair
        from ..pairs import get_pair

        pair = get_pair(getattr(args, "pair", None) or getattr(args, "pair_default", None) or "smollm2")
        return describe_default_pair(getattr(args, "small_layers", None)) if pair.small is None else pair.describe()
    parts = [item.replace("=", " = ", 1) for item in models]
    place = ", ".join(
        f"{flag} {v}"
        for flag, v in (("device", getattr(args, "device", None)), ("dtype", getattr(args, "dtype", None)))
        if v
    )
    return "pair: " + ", ".join(parts) + (f" ({place})" if place else "")


def policy_registry(args, prog: str):
    """``(registry, default name)``: the built-in registry plus the ``--policy-file`` class
    (registered under its class name, which is then the default), and the name to use when
    ``--policy`` is not given (None: the command's own default).

    Raises:
        SystemExit: a ``--policy-file`` that does not load (names the error).
    """
    from ..policies.registry import PolicySpecError, builtin_registry, load_policy_class

    registry = builtin_registry()
    target = getattr(args, "policy_file", None)
    if not target:
        return registry, None
    try:
        cls = load_policy_class(target)
    except PolicySpecError as e:
        raise fail(prog, f"--policy-file: {e}") from None
    registry.add(cls.__name__, cls)
    return registry, cls.__name__


def build_policy(registry, spec, prog: str, transport: str = "auto"):
    """The policy of a spec (a registry name with arguments), checked to reach sub-server
    processes unless ``transport`` is ``"thread"`` (`check_shippable`).

    Raises:
        SystemExit: an unknown name or a bad argument (names them and what is accepted), or a
            policy that cannot be sent to the sub-server processes.
    """
    from ..policies.registry import PolicySpecError

    try:
        policy = registry.build(spec)
    except PolicySpecError as e:
        raise fail(prog, f"--policy: {e}") from None
    if transport != "thread":
        check_shippable(policy, prog)
    return policy


def check_shippable(policy, prog: str) -> None:
    """Stop the command at start when ``policy`` cannot be sent to sub-server processes (or Ray
    actors), rather than failing every request that uses it (`tokenrouter_sdk.engine.transports.wire.shipping_problem`).

    Raises:
        SystemExit: names the policy, why, and the fixes.
    """
    from ..engine.transports.wire import shipping_problem

    why = shipping_problem(policy)
    if why is not None:
        raise fail(
            prog,
            f"policy {policy!r} cannot be sent to the sub-server processes: {why}. Keep locks, open "
            f"files and threads out of its attributes (create them in route), or run the sub-servers "
            f"in this process with --transport thread",
        )


def add_prefix_cache_flag(p: argparse.ArgumentParser) -> None:
    """``--no-prefix-cache`` (every command that builds a Router): ``args.no_prefix_cache``."""
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn the prefix cache off (every request feeds all its tokens; to measure what it saves)",
    )
