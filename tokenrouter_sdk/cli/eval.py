"""``tokenrouter eval``: a quality sweep from the command line (also ``evals/quality/hop_rate_sweep.py``).

The swept policy is a registry spec (``--policy rstitch:tau_back=0.02``, a learned head
``--policy r2r:head=heads/r2r_head.pt``, or the ``--policy-file`` class), ``--param`` names the
swept argument (default: the policy's threshold, see ``SWEPT``) and ``--values`` its values
(default: ``DEFAULT_VALUES`` for the training-free policies; for the others one point at the
policy's own value, e.g. a learned head's calibrated threshold). ``--policy`` repeated compares
several policies on one question set with one set of references (`evaluate_policies`). Each spec
may sweep its own argument: ``NAME:ARG=V1,V2,...`` (an argument given several comma-separated
values is the swept one; ``rstitch:tau=0.05,0.1,tau_back=0.02`` sweeps tau with tau_back fixed)
or ``NAME@V1,V2`` (values of its default swept argument); ``--param`` and ``--values`` apply to
the specs that sweep nothing of their own. A policy with nothing to sweep (no arguments, e.g.
``large_only``, or none known and no ``--param``) runs as one point as it is. The pair is the
packaged one or ``--model NAME=SOURCE`` with ``--device`` and ``--dtype``.

The command exits 1 when any point or reference had failed requests (the table's ``failed``
column and the notes under it say which and why), unless ``--allow-failures``.

Imports nothing heavy at module level, so ``tokenrouter --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from .common import (
    add_model_arguments,
    add_policy_arguments,
    describe_pair,
    fail,
    model_specs,
    per_model,
    policy_registry,
    tp_of,
)

# registry name -> the argument a sweep varies
SWEPT = {
    "rstitch": "tau",
    "random": "p",
    "random_query": "p",
    "r2r_entropy": "threshold",
    "r2r_aleatoric": "threshold",
    "glimprouter": "theta",
    "citer": "tau",
    "r2r": "tau",
    "co_llm": "eta",
    "query_router": "threshold",
}
DEFAULT_VALUES = {
    "rstitch": [0.02, 0.05, 0.1, 0.2, 0.4],
    "random": [0.02, 0.05, 0.1, 0.2, 0.4],
    "random_query": [0.02, 0.05, 0.1, 0.2, 0.4],
    "r2r_entropy": [0.02, 0.05, 0.1, 0.2, 0.4],
}


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--values must be comma-separated numbers, e.g. 0.02,0.05,0.1; got {s!r}"
        ) from None


def _shares(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(0 < x < 1 for x in out):
        raise argparse.ArgumentTypeError(
            f"--target-large-share takes shares in (0, 1), comma-separated, e.g. 0.3 or 0.1,0.3; got {s!r}"
        )
    return out


def add_arguments(p: argparse.ArgumentParser, *, out: bool = True) -> argparse.ArgumentParser:
    """The ``eval`` options (shared by the subcommand and ``evals/quality/hop_rate_sweep.py``);
    ``out=False`` leaves out ``--out`` (the caller sets ``args.out``, the output folder)."""
    add_policy_arguments(
        p,
        default="rstitch",
        what="the swept policy; repeat to compare several on one question set "
        "(a spec sweeps its own argument with NAME:ARG=V1,V2,... or "
        "NAME@V1,V2 for its default one; a policy with nothing to sweep "
        "runs as one point)",
        repeat=True,
    )
    p.add_argument(
        "--param",
        default=None,
        help="the swept argument of the policy (default: its threshold: "
        + ", ".join(f"{k} {v}" for k, v in SWEPT.items())
        + ")",
    )
    p.add_argument(
        "--values",
        type=_floats,
        default=None,
        help="comma-separated values of the swept argument (default 0.02,0.05,0.1,0.2,0.4 for rstitch, "
        "random, random_query, r2r_entropy; else one point at the policy's own value)",
    )
    p.add_argument(
        "--target-large-share",
        type=_shares,
        default=None,
        metavar="SHARE[,SHARE...]",
        help="calibrate each policy's threshold to these shares of tokens written by the large model "
        "on held-out questions (a bisection between 0, 1 and --values), then evaluate each; the "
        "table shows the target beside the realised share",
    )
    p.add_argument(
        "--calibration",
        type=int,
        default=32,
        metavar="N",
        help="held-out questions --target-large-share calibrates on (default 32; drawn after the evaluated ones)",
    )
    p.add_argument(
        "--include-head-questions",
        action="store_true",
        help="score a learned policy also on the questions its head was trained, validated or "
        "calibrated on (default: they are left out, and the output says how many)",
    )
    p.add_argument(
        "--dataset",
        default="gsm8k",
        help="gsm8k, math500, aime24, amc23 (shipped with the package), commonsenseqa, or a JSONL path",
    )
    p.add_argument("--limit", type=int, default=64, help="questions (default 64)")
    p.add_argument(
        "--seed", type=int, default=0, help="subset shuffle seed (-1: first --limit questions in file order)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="tokens generated per question at most (default 256)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight per point (default 16)")
    p.add_argument("--no-references", action="store_true", help="skip large-only, small-only and the random references")
    p.add_argument(
        "--references",
        default=None,
        help="comma-separated subset of large_only,small_only,random,random_span,random_query",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs per point, interleaved over the points; the throughput is their median (default 2)",
    )
    p.add_argument(
        "--cache",
        choices=["clear", "keep"],
        default="clear",
        help="prefix caches before each timed run: clear (default: every run starts from a new Router's state) or keep",
    )
    p.add_argument(
        "--allow-failures", action="store_true", help="exit 0 even when requests failed (the results keep the failures)"
    )
    p.add_argument(
        "--transport",
        choices=["auto", "process", "thread"],
        default="auto",
        help="sub-servers in processes or threads (default: processes for two torch models)",
    )
    add_model_arguments(p, pair_default="qwen2.5-coder")
    p.add_argument(
        "--mode",
        default="async",
        choices=["async", "delayed", "sync", "model_sync"],
        help="schedule mode (default async)",
    )
    from .common import add_prefix_cache_flag

    add_prefix_cache_flag(p)
    if out:
        p.add_argument(
            "--out",
            default="eval_out",
            help="output folder (resumable): results.csv/json, plot.html, figures/*.png|pdf",
        )
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("sweeps over several workers (docs/distributed.md)")
    g.add_argument(
        "--shard",
        metavar="I/N",
        help="run only the I-th of N shares of the points into --out (then --merge); each shard builds its own Router",
    )
    g.add_argument("--shards", type=int, metavar="N", help="launch all N shards (--launcher) and merge them")
    g.add_argument(
        "--launcher",
        choices=["local", "ray"],
        default="local",
        help="--shards as processes of this machine (default) or Ray tasks",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster address for --launcher ray (default: start or join the local one)",
    )
    g.add_argument("--shard-cpus", type=float, default=1, help="CPUs per shard (torch threads locally; Ray num_cpus)")
    g.add_argument("--shard-gpus", type=float, default=0, help="GPUs per shard (Ray num_gpus)")
    g.add_argument("--merge", action="store_true", help="merge the finished shards in --out (runs no model)")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``tokenrouter`` subparsers."""
    p = sub.add_parser("eval", help="quality at hop rate: sweep a policy's threshold on a benchmark")
    add_arguments(p).set_defaults(fn=cmd_eval)
    return p


def _split_values(spec: str, prog: str) -> tuple[str, list[float] | None]:
    """``"name:k=v@0.1,0.2"`` -> ``("name:k=v", [0.1, 0.2])``; no ``@V,...`` tail: values None."""
    head, at, tail = spec.rpartition("@")
    if not at:
        return spec, None
    try:
        return head, _floats(tail)
    except argparse.ArgumentTypeError:
        raise fail(
            prog, f"--policy {spec!r}: the part after @ must be comma-separated numbers, e.g. rstitch@0.05,0.1"
        ) from None


def parse_sweep_spec(spec: str) -> tuple[str, dict[str, str], str | None, list[str] | None]:
    """``"name:a=1,b=0.1,0.2,0.4"`` -> ``("name", {"a": "1"}, "b", ["0.1", "0.2", "0.4"])``: the
    fixed arguments and the one argument given several comma-separated values (its values as
    text), or ``(name, fixed, None, None)`` when every argument has one value.

    Raises:
        PolicySpecError: an empty name, a value before any ``key=``, or several swept arguments.
    """
    from ..policies.registry import PolicySpecError, _split_top

    name, _, rest = spec.strip().partition(":")
    if not name.strip():
        raise PolicySpecError(f"empty policy name in {spec!r}; write e.g. 'rstitch:tau=0.05,0.1'")
    args: dict[str, list[str]] = {}
    key = None
    for item in _split_top(rest, ",") if rest.strip() else []:
        k, eq, value = item.partition("=")
        if eq and k.strip():
            key = k.strip()
            args[key] = [value.strip()]
        elif key is not None and item.strip():
            args[key].append(item.strip())  # one more value of the argument before it: swept
        else:
            raise PolicySpecError(
                f"policy argument {item!r} in {spec!r} is not key=value; write e.g. "
                f"'{name.strip()}:tau=0.05,0.1' (several values sweep that argument)"
            )
    swept = [k for k, v in args.items() if len(v) > 1]
    if len(swept) > 1:
        raise PolicySpecError(
            f"{spec!r} gives several values to {swept}: a policy sweeps one argument; fix the "
            f"others to one value, or give the policy twice with different names"
        )
    fixed = {k: v[0] for k, v in args.items() if len(v) == 1}
    return name.strip(), fixed, (swept[0] if swept else None), (args[swept[0]] if swept else None)


def _one(registry, spec: str, values, args, prog: str):
    """``(name, factory, param, values)`` of one ``--policy`` spec; a policy that runs as one
    point as it is (no argument to sweep) gives ``(name, policy, None, [None])``."""
    from ..policies.registry import PolicySpecError

    try:
        name, fixed, own_param, own_values = parse_sweep_spec(spec)
        entry = registry.get({"query": "query_router"}.get(name.strip().lower(), name))
    except PolicySpecError as e:
        raise fail(prog, f"--policy: {e}") from None
    pair = heads_pair(args, prog)
    if pair is not None and "pair" in entry.params and not {"pair", "head"} & set(fixed):
        fixed = dict(fixed, pair=pair)  # a learned policy without a head file: the evaluated pair's packaged head
    if own_param is not None:  # the spec sweeps its own argument: --param and --values are for the others
        if values is not None and values is not args.values:
            raise fail(
                prog, f"--policy {spec!r}: sweep {own_param} with its values in the spec or with @V1,V2, not both"
            )
        if own_param not in entry.params:
            raise fail(
                prog,
                f"--policy: policy '{entry.name}' has no argument {own_param!r}; its arguments: "
                f"{list(entry.params) or 'none'}",
            )
        try:
            values = [float(v) for v in own_values]
        except ValueError:
            raise fail(
                prog,
                f"--policy {spec!r}: the values of {own_param} must be numbers, e.g. {entry.name}:{own_param}=0.05,0.1",
            ) from None
        return _sweep(registry, entry, fixed, own_param, values, prog)
    param = args.param or SWEPT.get(entry.name)
    if param is None and values is not None and values is not args.values:
        raise fail(
            prog,
            f"--policy {spec!r}: policy '{entry.name}' has no known swept argument for @V1,V2; name "
            f"it in the spec ({entry.name}:ARG=V1,V2; its arguments: {list(entry.params) or 'none'})",
        )
    if param is None and (values is None or not entry.params):
        try:  # nothing to sweep: the policy as given, one point
            pol = registry.build({"name": entry.name, **fixed})
        except PolicySpecError as e:
            raise fail(prog, f"--policy: {e}") from None
        return entry.name, pol, None, [None]
    if param is None:
        raise fail(
            prog,
            f"--param: policy '{entry.name}' has no known swept argument; name one of "
            f"{list(entry.params)} (or sweep it in the spec: {entry.name}:ARG=V1,V2)",
        )
    if param not in entry.params:
        raise fail(
            prog, f"--param: policy '{entry.name}' has no argument {param!r}; its arguments: {list(entry.params)}"
        )
    if param in fixed and values is not None:
        raise fail(prog, f"--policy fixes {param}={fixed[param]} and --values sweeps it: give one of them")
    if values is None:
        values = DEFAULT_VALUES.get(entry.name) if param not in fixed and not args.param else None
        if values is None:  # one point: the policy as given (a learned head at its calibrated threshold)
            try:
                pol = registry.build({"name": entry.name, **fixed})
            except PolicySpecError as e:
                raise fail(prog, f"--policy: {e}") from None
            value = getattr(pol, param, None)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise fail(
                    prog, f"--values: policy '{entry.name}' has no number {param} of its own ({value!r}); give --values"
                )
            values = [value]
    return _sweep(registry, entry, fixed, param, values, prog)


def _sweep(registry, entry, fixed: dict, param: str, values, prog: str):
    """``(name, factory value -> policy, param, values)`` of a policy swept over ``param``."""
    from ..policies.registry import PolicySpecError

    def factory(v, _name=entry.name, _fixed=dict(fixed), _param=param):  # noqa: B006 - bound per entry
        try:
            v = int(v) if isinstance(v, float) and v.is_integer() else v  # 1.0 fits an int argument too
            return registry.build({"name": _name, **_fixed, _param: v})
        except PolicySpecError as e:
            raise fail(prog, f"--policy: {e}") from None

    return entry.name, factory, param, list(values)


def heads_pair(args, prog: str) -> str | None:
    """The named pair whose packaged heads the learned policies load when their spec names no
    head: the evaluated pair (``--pair``, or the command's default) unless it is SmolLM2's (the
    policies' own default) or ``--model`` names the models (None)."""
    from .common import pair_of

    pair = pair_of(args, prog)
    return None if pair in (None, "smollm2") else pair


def sweeps(args, prog: str = "tokenrouter eval") -> list[tuple[str, object, str, list]]:
    """``[(name, factory value -> policy, swept argument, values), ...]``, one per ``--policy``
    (default: the ``--policy-file`` class, else rstitch), with ``--param`` and ``--values`` (a
    spec's own sweep, ``NAME:ARG=V1,V2,...`` or ``NAME@V1,V2``, wins). A policy with nothing to
    sweep (no arguments, or none known and no ``--param``) gives ``(name, the policy, None,
    [None])``: one point, as it is. Names are the registry names, or the spec when two policies
    share one.

    Raises:
        SystemExit: an unknown policy or argument, no known swept argument without ``--param``,
            or the swept argument fixed in the spec as well as given by values.
    """
    registry, own = policy_registry(args, prog)
    given = args.policy if isinstance(args.policy, list) else [args.policy] if args.policy else []
    specs = given or [own or "rstitch"]
    out = []
    for spec in specs:
        text, values = _split_values(spec, prog)
        out.append((text, *_one(registry, text, values if values is not None else args.values, args, prog)))
    names = [name for _, name, *_ in out]
    return [(name if names.count(name) == 1 else text, *rest) for text, name, *rest in out]


def sweep(args, prog: str = "tokenrouter eval"):
    """``(factory value -> policy, swept argument, values)`` of the (first) ``--policy`` (see
    `sweeps`)."""
    _, factory, param, values = sweeps(args, prog)[0]
    return factory, param, values


def _check_dataset(args, prog: str) -> None:
    """Load ``--dataset`` (its ``--limit`` and ``--seed`` draw) before any model loads.

    Raises:
        SystemExit: one line naming the dataset and the fix (an empty name, an unknown
            benchmark, a missing or empty file, rows without an answer).
    """
    from ..eval.datasets import load_benchmark

    name = (args.dataset or "").strip()
    if args.limit is not None and args.limit < 1:
        raise fail(prog, f"--limit must be >= 1 (questions), got {args.limit}")
    if not name:
        raise fail(
            prog,
            "--dataset is empty: give a benchmark (gsm8k, math500, aime24, amc23, commonsenseqa) or the "
            "path of a JSONL file with {id, question, answer} rows",
        )
    try:
        load_benchmark(name, limit=args.limit, seed=None if args.seed < 0 else args.seed)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise fail(prog, f"--dataset {name!r}: {e}") from None


def _shard_launch_argv(args) -> list[str]:
    """The command line of one shard: this command's arguments less the launcher's own."""
    argv, skip = [], {"--shards", "--launcher", "--ray-address", "--shard-cpus", "--shard-gpus", "--out"}
    raw = getattr(args, "argv", None)
    if raw is None:
        raise SystemExit("tokenrouter eval --shards: the command line is unknown (run it as `tokenrouter eval ...`)")
    k = 0
    while k < len(raw):
        a = raw[k]
        name = a.split("=", 1)[0]
        if name in skip:
            k += 1 if "=" in a else 2
            continue
        if name in ("--merge", "--no-progress"):
            k += 1
            continue
        argv.append(a)
        k += 1
    return argv


def cmd_eval(args) -> int:
    """Run the sweep on the pair the flags name (or one shard of it, or all shards, or the merge),
    print the table, write the files."""
    from transformers.utils import logging as hf_logging

    from ..eval import evaluate_policies, evaluate_policy
    from ..eval.sweep import merge_sweep

    prog = "tokenrouter eval"
    hf_logging.disable_progress_bar()
    if args.shard and (args.shards or args.merge):
        raise SystemExit(
            "tokenrouter eval: --shard runs one shard; --shards N launches all of them and --merge "
            "merges finished ones: give one of them"
        )
    if args.shards or not args.merge:
        _check_dataset(args, prog)
    if args.shards or args.merge:
        if args.shards:
            from ..eval.shards import run_local, run_ray

            if args.shards < 1:
                raise SystemExit(f"tokenrouter eval: --shards must be >= 1, got {args.shards}")
            argv = _shard_launch_argv(args)
            if args.launcher == "ray":
                run_ray(
                    argv,
                    args.shards,
                    args.out,
                    main,
                    address=args.ray_address,
                    num_cpus=args.shard_cpus,
                    num_gpus=args.shard_gpus,
                )
            else:
                run_local(argv, args.shards, args.out, threads=max(1, int(args.shard_cpus)))
        try:
            res = merge_sweep(args.out)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"tokenrouter eval: {e}") from None
        print(res.table())
        print(
            f"\n{len(res.records)} points from {res.config['shards']} shards merged; wrote {args.out}/results.csv, "
            f"results.json, plot.html{_figures_text(args.out)}"
        )
        return _exit(res, args, prog)
    entries = sweeps(args, prog)
    if args.transport != "thread":
        from .common import check_shippable

        for _, factory, param, values in entries:
            check_shippable(factory if param is None else factory(values[0]), prog)
    if args.repeats < 1:
        raise fail(prog, f"--repeats must be >= 1, got {args.repeats}")
    specs = model_specs(args, prog)
    if specs is None:
        from ..pairs import get_pair
        from .common import pair_of

        pair = pair_of(args, prog)
        names = ["small", "large"] if get_pair(pair).small is not None else None
        target, kwargs = (
            "default",
            {
                "pair": pair,
                "small_layers": args.small_layers,
                "mode": args.mode,
                "device": per_model(args.device, names, "--device", prog),
                "dtype": per_model(args.dtype, names, "--dtype", prog),
            },
        )
        tp = tp_of(args, ["small", "large"], prog)
        if tp:
            kwargs["tp"] = tp
    else:
        target, kwargs = specs, {"mode": args.mode}
    kwargs["prefix_cache"] = not args.no_prefix_cache
    if args.transport != "auto":
        kwargs["processes"] = args.transport == "process"
    if args.model_impl:
        kwargs["model_impl"] = args.model_impl
    if args.kernels:
        kwargs["kernels"] = args.kernels
    if args.allow_unknown_attention:
        kwargs["allow_unknown_attention"] = True
    print(describe_pair(args), flush=True)
    refs = False if args.no_references else (args.references.split(",") if args.references else True)
    from ..eval.calibrate import CalibrationError
    from ..models import ModelLoadError
    from ..placement import DeviceError

    common = dict(
        dataset=args.dataset,
        limit=args.limit,
        seed=None if args.seed < 0 else args.seed,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        concurrency=args.concurrency,
        references=refs,
        out_dir=args.out,
        progress=not args.no_progress,
        router_kwargs=kwargs,
        exclude_head_questions=not args.include_head_questions,
        shard=args.shard,
        repeats=args.repeats,
        cache=args.cache,
    )
    if args.target_large_share:  # each point's threshold calibrated to its share on held-out questions
        common.update(target_large_share=args.target_large_share, calibration=args.calibration)
    try:
        if len(entries) == 1:
            _, factory, param, values = entries[0]
            res = (
                evaluate_policy(target, factory, **common)
                if param is None
                else evaluate_policy(target, factory, values, param=param, **common)
            )
        else:
            res = evaluate_policies(
                target,
                {
                    name: factory if param is None else (factory, values, param)
                    for name, factory, param, values in entries
                },
                **common,
            )
    except (DeviceError, ModelLoadError) as e:
        raise fail(prog, f"{type(e).__name__}: {e}") from None
    except CalibrationError as e:
        raise fail(prog, f"--target-large-share: {e}") from None
    print(res.table())
    resumed = sum(r["resumed"] for r in res.records)
    ran = [r for r in res.records if not r["resumed"]]
    print(
        f"\nprompt tokens: {sum(r.get('prompt_tokens', 0) for r in ran)} over the points run, of which "
        f"{sum(r.get('prefix_hit_tokens', 0) for r in ran)} reused from the prefix cache and "
        f"{sum(r.get('prompt_tokens_fed', 0) for r in ran)} prefilled"
    )
    if args.shard:
        print(
            f"shard {args.shard}: {len(res.records)} points ({resumed} resumed) into {args.out}/points; merge the "
            f"finished shards with: tokenrouter eval --merge --out {args.out}"
        )
        return _exit(res, args, prog)
    print(
        f"{len(res.records)} points ({resumed} resumed from {args.out}/points), "
        f"{res.config['elapsed_s']:.0f} s; wrote {args.out}/results.csv, results.json, plot.html"
        f"{_figures_text(args.out)}"
    )
    return _exit(res, args, prog)


def _figures_text(out) -> str:
    """How the static figures were written: the files under ``out/figures``, or how to get them."""
    from pathlib import Path

    from ..eval.result import FIGURES_DIR

    files = sorted(p.name for p in (Path(out) / FIGURES_DIR).glob("*.*"))
    if files:
        return f" and {len(files)} figures in {Path(out) / FIGURES_DIR} ({', '.join(files)})"
    return " (no PNG/PDF figures: pip install 'tokenrouter-sdk[figures]' for them)"


def _exit(res, args, prog: str) -> int:
    """1 when a point had failed requests (named on stderr), unless ``--allow-failures``; else 0."""
    bad = res.failures
    if not bad:
        return 0
    names = ", ".join(f"{b['label']} ({b['failed']} of {b['n']})" for b in bad)
    print(
        f"{prog}: requests failed in {len(bad)} point(s): {names}; first error: {bad[0]['first_error']}"
        + ("" if args.allow_failures else " (exit 1; --allow-failures keeps the exit status 0)"),
        file=sys.stderr,
    )
    return 0 if args.allow_failures else 1


def main(argv: list[str] | None = None) -> int:
    """Run ``tokenrouter eval`` with ``argv`` (default: ``sys.argv[1:]``)."""
    p = add_arguments(argparse.ArgumentParser(prog="tokenrouter eval", description=__doc__))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv
    return cmd_eval(args)


if __name__ == "__main__":
    sys.exit(main())
