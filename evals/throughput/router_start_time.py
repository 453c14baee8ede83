"""How long `Router.default()` takes to build with sub-server processes: the first build in a
fresh interpreter (cold) and the median of the next N builds in the same interpreter (warm),
each Router closed before the next is built.

Every configuration runs in its own fresh interpreter (this script, re-run with ``--child``), one
after the other, so one run compares them side by side:

  forkserver          the default: sub-servers forked from the fork server (torch and
                      transformers imported once per interpreter), the pair reused from the
                      previous Router (`default_pair(reuse=True)`), which the loop keeps
                      referenced while it builds the next one, as a re-run notebook cell does
                      (``router = Router.default()``: the old Router is still bound to ``router``)
  forkserver-reload   the same with the previous Router dropped (``del``, gc) before each build
                      and ``reuse=False``: the pair is loaded and moved to shared memory each time
  forkserver-late     the default without `Router.default` starting the fork server before it
                      loads the pair (the server then starts with the first transport)
  spawn-reload        ``processes={"start_method": "spawn"}``, reload: a fresh interpreter per
                      sub-server (imports torch and transformers each time)
  baseline            (``--baseline-src DIR``) ``Router.default()`` of another checkout of the
                      package (e.g. the commit before the fork server), as it is by default

Per build: wall seconds of ``Router.default(...)``; then of the first message round trip
(``router.kv_stats()``) and of a first 2-token ``generate``; ``close()`` (after an 8-token
generate hopping between the models, so both have run). Phases (where the
code under test reports them): ``load`` (`default_pair`), ``runners`` (the Router's own set-up:
runners, engine, template), ``start`` (`ProcessTransport.start`), and per sub-server the
transport's ``boot`` times (process start, child entry, pickling the spec, transfer,
unpickling, SubServer build, connect). Before ``close()``: the sub-server processes' resident
memory from /proc (RssAnon / RssShmem: anonymous / shared-memory pages, shared ones counted in
full in every process; Pss: shared pages divided among the processes mapping them; Private:
pages only this process maps) next to the pair's parameter bytes.

Timing on a shared machine is noisy: the load average before and after each configuration is
recorded; compare medians measured side by side.

Run:
    .venv/bin/python evals/throughput/router_start_time.py --builds 5 --out evals/results/throughput
    .venv/bin/python evals/throughput/router_start_time.py --configs forkserver spawn-reload --builds 5

Writes ``<out>/router_start_time.json`` (every build's times, phases and memory, per configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

CONFIGS = {
    "forkserver": {"start_method": "forkserver", "reuse": True, "drop": False},
    "forkserver-reload": {"start_method": "forkserver", "reuse": False, "drop": True},
    "spawn-reload": {"start_method": "spawn", "reuse": False, "drop": True},
    "forkserver-late": {"start_method": "forkserver", "reuse": True, "drop": False, "prestart": False},
    "baseline": {"start_method": None, "reuse": None, "drop": True},
}


def _rss(pid: int) -> dict:
    """Resident memory of a process, bytes: RSS split into anonymous / file / shared memory
    (/proc/PID/status; pages shared with other processes count in full in each) and the
    proportional set size and private pages (/proc/PID/smaps_rollup)."""
    out = {}
    for path, keys in (
        (f"/proc/{pid}/status", ("VmRSS", "RssAnon", "RssFile", "RssShmem")),
        (f"/proc/{pid}/smaps_rollup", ("Pss", "Private_Clean", "Private_Dirty")),
    ):
        try:
            with open(path) as f:
                for line in f:
                    key, _, val = line.partition(":")
                    if key in keys:
                        out[key] = int(val.split()[0]) * 1024
        except OSError:
            pass
    if "Private_Clean" in out:
        out["Private"] = out.pop("Private_Clean") + out.pop("Private_Dirty", 0)
    return out


def _child(cfg: dict, builds: int) -> dict:
    """One configuration in this (fresh) interpreter: 1 + ``builds`` Router builds."""
    import gc

    t0 = time.perf_counter()
    import tokenrouter_sdk.models as models
    from tokenrouter_sdk import Router
    from tokenrouter_sdk.engine.transports import process_transport
    from tokenrouter_sdk.policies import RandomRouting

    import_s = time.perf_counter() - t0

    phase: dict = {}

    def timed(obj, attr, key):
        orig = getattr(obj, attr)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                phase[key] = phase.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, attr, wrapper)

    timed(models, "default_pair", "load")
    if cfg.get("prestart") is False:  # the fork server starts with the first transport, not before the load
        from tokenrouter_sdk.engine.transports import process_start

        process_start.prestart_for = lambda *a, **k: None
    timed(process_transport.ProcessTransport, "start", "start")
    kwargs = {}
    if cfg["start_method"] is not None:
        kwargs["processes"] = {"start_method": cfg["start_method"]}
    if cfg["reuse"] is not None:
        kwargs["reuse"] = cfg["reuse"]
    rows, router, tr = [], None, None
    for i in range(1 + builds):
        if cfg["drop"] and router is not None:
            router = tr = None  # the transport holds the engine, which holds the models
            gc.collect()
        phase.clear()
        t = time.perf_counter()
        router = Router.default(**kwargs)
        build_s = time.perf_counter() - t
        tr = router.engine.transport
        t = time.perf_counter()
        router.kv_stats()
        round_trip_s = time.perf_counter() - t
        t = time.perf_counter()
        out = router.generate(["Say hi."], max_new_tokens=2)
        generate_s = time.perf_counter() - t
        router.generate(["Name three colours."], max_new_tokens=8, policy=RandomRouting(p=0.5, seed=0))
        assert out[0].error is None, out[0].error
        pids = tr.pids() if hasattr(tr, "pids") else {}
        rss = {m: _rss(p) for m, p in pids.items()}
        boot = {m: dict(b) for m, b in getattr(tr, "boot", {}).items()}
        t = time.perf_counter()
        router.close()
        close_s = time.perf_counter() - t
        seen, weight_bytes = set(), 0
        for m in router.models.values():
            for p in m.parameters():
                if p.untyped_storage().data_ptr() not in seen:
                    seen.add(p.untyped_storage().data_ptr())
                    weight_bytes += p.untyped_storage().nbytes()
        rows.append(
            {
                "build": i,
                "build_s": build_s,
                "round_trip_s": round_trip_s,
                "first_generate_s": generate_s,
                "close_s": close_s,
                "load_s": phase.get("load"),
                "start_s": phase.get("start"),
                "runners_s": build_s - phase.get("load", 0.0) - phase.get("start", 0.0),
                "boot": boot,
                "rss": rss,
                "weight_bytes": weight_bytes,
                "pids": pids,
            }
        )
        print(f"  build {i}: {build_s:.2f} s", file=sys.stderr, flush=True)
    return {"import_s": import_s, "builds": rows}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _summary(name: str, runs: list[dict]) -> dict:
    """One configuration over its runs (fresh interpreters): the cold build of each run, every
    warm build of every run."""
    cold = [res["builds"][0] for res in runs]
    warm = [r for res in runs for r in res["builds"][1:]]
    phases = {
        key: _median([r[key] for r in warm])
        for key in ("load_s", "runners_s", "start_s", "round_trip_s", "first_generate_s", "close_s")
    }
    cold_phases = {key: _median([r[key] for r in cold]) for key in ("load_s", "runners_s", "start_s")}

    def boot_medians(rows):
        keys = sorted({k for r in rows for b in r["boot"].values() for k, v in b.items() if isinstance(v, float)})
        return {
            m: {k: _median([r["boot"].get(m, {}).get(k) for r in rows]) for k in keys}
            for m in sorted({m for r in rows for m in r["boot"]})
        }

    last = (warm or cold)[-1]
    return {
        "config": name,
        "cold_build_s": _median([r["build_s"] for r in cold]),
        "cold_builds_s": [r["build_s"] for r in cold],
        "warm_median_s": _median([r["build_s"] for r in warm]),
        "warm_builds_s": [r["build_s"] for r in warm],
        "import_s": _median([res["import_s"] for res in runs]),
        "warm_phases": phases,
        "cold_phases": cold_phases,
        "warm_boot": boot_medians(warm),
        "cold_boot": boot_medians(cold),
        "rss_last": last["rss"],
        "weight_bytes": last["weight_bytes"],
        "preloaded": {m: b.get("preloaded") for m, b in last["boot"].items()},
    }


def main(argv=None) -> dict:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--builds", type=int, default=5, help="warm builds after the first one (default 5)")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["forkserver", "forkserver-reload", "spawn-reload"],
        choices=sorted(CONFIGS),
        help="configurations to run, in this order",
    )
    ap.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="a checkout whose tokenrouter_sdk the 'baseline' configuration imports (added to the "
        "configurations when given)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per configuration (fresh interpreters), interleaved across configurations (default 1)",
    )
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per configuration (default 1200)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(CONFIGS[args.child], args.builds)))
        return {}
    configs = list(args.configs)
    if args.baseline_src is not None and "baseline" not in configs:
        configs.append("baseline")
    if "baseline" in configs and args.baseline_src is None:
        ap.error("the 'baseline' configuration needs --baseline-src DIR")
    here = Path(__file__).resolve().parents[2]
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "builds": args.builds,
        "configs": [],
    }
    runs: dict[str, list] = {name: [] for name in configs}
    loads: dict[str, list] = {name: [] for name in configs}
    for rep in range(args.repeat):  # interleaved, so a change in the machine's load hits every configuration
        for name in configs:
            env = {k: v for k, v in os.environ.items() if k != "TOKENROUTER_PROCESSES"}
            src = args.baseline_src if name == "baseline" else here
            env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve()), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            )
            load_before = os.getloadavg()[0]
            print(
                f"{name} (run {rep + 1} of {args.repeat}): 1 + {args.builds} builds (load average {load_before:.1f})",
                flush=True,
            )
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", name, "--builds", str(args.builds)],
                capture_output=True,
                text=True,
                env=env,
                timeout=args.timeout,
                cwd=str(here),
            )
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            loads[name].append([load_before, os.getloadavg()[0]])
    for name in configs:
        summary = _summary(name, runs[name])
        summary["load_average_before_after"] = loads[name]
        summary["raw"] = runs[name]
        result["configs"].append(summary)
    print()
    print(f"{'config':<18} {'cold s':>7} {'warm median s':>14}   cold builds s | warm builds s")
    for s in result["configs"]:
        warm = "-" if s["warm_median_s"] is None else f"{s['warm_median_s']:.2f}"
        print(
            f"{s['config']:<18} {s['cold_build_s']:7.2f} {warm:>14}   "
            + " ".join(f"{x:.2f}" for x in s["cold_builds_s"])
            + " | "
            + " ".join(f"{x:.2f}" for x in s["warm_builds_s"])
        )
    for s in result["configs"]:
        ph = {k: round(v, 3) for k, v in s["warm_phases"].items() if v is not None}
        cph = {k: round(v, 3) for k, v in s["cold_phases"].items() if v is not None}
        print(
            f"\n{s['config']}: cold phases (median s) {cph}; warm phases (median s) {ph}; "
            f"load average before/after each run {s['load_average_before_after']}"
        )
        for m, b in s["warm_boot"].items():
            print(f"  {m} boot (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in b.items() if v is not None))
        for m, r in s["rss_last"].items():
            print(
                f"  {m} RSS MB: "
                + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r.items())
                + f" (weights {s['weight_bytes'] / 2**20:.0f} MB)"
            )
    path = evalkit.Output(args, __file__).path(".json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
