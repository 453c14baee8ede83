"""The side-by-side throughput benchmark (``tokenrouter bench``, ``evals/throughput/side_by_side.py``).

One run measures, on one set of prompts, every combination of policy x schedule mode x
concurrency x output length that is asked for, plus the baselines (``retain_kv=False``,
large-only, small-only; the ``retain_kv=False`` baseline also runs without the prefix cache, so a
return re-prefills everything), and reports committed-token throughput, mean latency, per-user speed,
realized hop rate and large fraction, with ratios to ``sync`` and to ``retain_kv=False`` in the
same cell. All figures come from `Router.metrics` (committed tokens only).

Policies: ``random10`` / ``random30`` = `RandomRouting` with p = f, which gives a large fraction f
(every small step ends in exactly one committed token: the small one, or with probability p the
large model's after the small one is discarded);
``rstitch`` = `RStitch` at its default tau; any other label is a registry spec
(`tokenrouter_sdk.policies.registry`, e.g. ``rstitch:tau=0.3,tau_back=0.02``).
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field

MODES = ("sync", "model_sync", "async", "delayed")


@dataclass
class Cell:
    policy: str
    mode: str
    retain_kv: bool
    concurrency: int
    max_new_tokens: int
    thresholds: str = ""
    throughput_tok_s: float = 0.0
    mean_latency_s: float = 0.0
    per_user_tok_s: float = 0.0
    hop_rate: float = 0.0
    large_fraction: float = 0.0
    committed_tokens: int = 0
    wall_s: float = 0.0
    vs_sync: float | None = None
    vs_no_retain: float | None = None
    failed: int = 0  # requests of the cell that failed or were aborted (its numbers then do not stand)
    accounting: dict = field(default_factory=dict)  # per model: `tokenrouter_sdk.demo.step_accounting` of the cell


def make_policy(name: str, registry=None):
    """The policy of a bench label: ``random<PCT>`` (`RandomRouting` at p = PCT/100, seed 0), or a
    registry spec (``rstitch``, ``rstitch:tau=0.3,tau_back=0.02``, a learned head, a class added
    to ``registry``; default: the built-in registry).

    Raises:
        PolicySpecError: an unknown name or argument.
    """
    from .policies import RandomRouting

    if name.startswith("random") and name[len("random") :].isdigit():
        return RandomRouting(p=int(name[len("random") :]) / 100, seed=0)
    if registry is None:
        from .policies.registry import builtin_registry

        registry = builtin_registry()
    return registry.build(name)


def _thresholds(router, policy, n: int, spec: str | dict | None) -> dict[str, int]:
    """Thresholds for a ``delayed`` cell at concurrency n, lowered (largest first) until
    feasible: sum_i (B_i - 1) < n."""
    if isinstance(spec, dict):
        th = dict(spec)
    elif spec in (None, "", "auto"):
        from .planner import plan_for_router

        th = plan_for_router(router, policy, n)
    else:
        th = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    while sum(b - 1 for b in th.values()) >= n:
        th[max(th, key=th.get)] -= 1
    return th


def bench_cells(
    policies=("random10", "random30", "rstitch"),
    modes=MODES,
    concurrency=(1, 4, 8, 16),
    max_new_tokens=(256,),
    baselines=True,
) -> list[tuple]:
    """The benchmark matrix as ``(policy, mode, retain_kv, concurrency, max_new_tokens)`` tuples:
    every policy x mode x concurrency x length, ``retain_kv=False`` beside each ``async`` and
    ``delayed`` cell (with ``baselines``), then large-only and small-only per concurrency and length."""
    cells = []
    for pol, mode, n, new in itertools.product(policies, modes, concurrency, max_new_tokens):
        cells.append((pol, mode, True, n, new))
        if baselines and mode in ("async", "delayed"):
            cells.append((pol, mode, False, n, new))
    if baselines:
        for n, new in itertools.product(concurrency, max_new_tokens):
            cells += [("large_only", "async", True, n, new), ("small_only", "async", True, n, new)]
    return cells


def run_bench(
    models: dict,
    tokenizer,
    prompts: list,
    *,
    policies=("random10", "random30", "rstitch"),
    modes=MODES,
    concurrency=(1, 4, 8, 16),
    max_new_tokens=(256,),
    baselines=True,
    thresholds: str | dict | None = "auto",
    progress: bool = True,
    cells: list[tuple] | None = None,
    deadline: float | None = None,
    on_cell=None,
    warmup_tokens: int = 0,
    max_routers: int | None = None,
    registry=None,
    **router_kw,
) -> list[Cell]:
    """Run the benchmark matrix; returns one `Cell` per measured configuration.

    Args:
        models: name -> model (smallest first), as for `Router`.
        tokenizer: the shared tokenizer.
        prompts: prompts; each cell uses ``2 * concurrency`` of them (cycled), so the
            concurrency stays at its value until the tail.
        policies, modes, concurrency, max_new_tokens, baselines: the matrix (`bench_cells`).
        thresholds: ``delayed`` thresholds: "auto" (planner), "small=8,large=4" or a dict.
        cells: an explicit, ordered list of ``(policy, mode, retain_kv, concurrency,
            max_new_tokens)`` to run instead of the matrix (most important first, with ``deadline``).
        deadline: a ``time.monotonic()`` value; no cell starts after it (the cells run so far
            are returned; a GPU lease or CI slot ends on time).
        on_cell: called with each finished `Cell` (e.g. to append it to a CSV as it comes).
        warmup_tokens: when > 0, each new Router first generates this many tokens for
            ``2 * max(concurrency)`` requests with the policy of the cell that opened it, unmeasured
            (CUDA context, kernels, allocator, and the CUDA graphs of the buckets it reaches).
        max_routers: Routers kept open at once (one per (mode, retain_kv); each holds a process,
            a KV pool and, with ``cuda_graphs``, captured graphs per model). None keeps all open;
            1 closes each before the next opens (a GPU with little memory for large pairs);
            the least recently used one is closed first.
        registry: where policy specs are looked up (`make_policy`; default: the built-ins).
        router_kw: passed to `Router` (``backend``, ``max_kv_tokens``, ``processes``, ...).
    """
    from tqdm.auto import tqdm

    from .demo import step_accounting
    from .router import Router

    if cells is None:
        cells = bench_cells(policies, modes, concurrency, max_new_tokens, baselines)
    if router_kw.get("backend", "torch") == "torch" and "max_kv_tokens" not in router_kw and cells:
        # every request reserves prompt + max_new_tokens of KV on admission: size the pools so
        # that KV never limits a cell's concurrency
        longest = max(_prompt_tokens(tokenizer, p) for p in prompts)
        top = max(c[3] * (longest + c[4]) for c in cells)
        router_kw["max_kv_tokens"] = max(8192, top)
    out: list[Cell] = []
    bar = tqdm(total=len(cells), desc="bench", disable=not progress)
    routers: dict = {}
    try:
        for pol, mode, retain, n, new in cells:
            if deadline is not None and time.monotonic() > deadline:
                break
            policy = make_policy(pol, registry)
            key = (mode, retain)
            if key in routers:
                routers[key] = routers.pop(key)  # most recently used last
            else:
                while max_routers is not None and routers and len(routers) >= max_routers:
                    routers.pop(next(iter(routers))).close()
                kw = router_kw if retain else {**router_kw, "prefix_cache": False}  # the baseline re-prefills all
                routers[key] = Router(models, tokenizer=tokenizer, mode=mode, retain_kv=retain, **kw)
                if warmup_tokens > 0:
                    top = max(c[3] for c in cells)
                    warm = [prompts[i % len(prompts)] for i in range(2 * top)]
                    routers[key].generate(
                        warm,
                        policy=make_policy(pol, registry),
                        max_new_tokens=warmup_tokens,
                        ignore_eos=True,
                        concurrency=top,
                    )
            r = routers[key]
            th = ""
            if mode == "delayed":
                r.set_thresholds(_thresholds(r, policy, n, thresholds))
                th = ",".join(f"{k}={v}" for k, v in r.thresholds.items())
            work = [prompts[i % len(prompts)] for i in range(2 * n)]
            call = r.submit(work, policy=policy, max_new_tokens=new, ignore_eos=True, concurrency=n)
            call.wait()
            m = call.metrics()
            out.append(
                Cell(
                    pol,
                    mode,
                    retain,
                    n,
                    new,
                    th,
                    m.throughput_tok_s,
                    m.mean_latency_s,
                    m.per_user_tok_s,
                    m.hop_rate,
                    m.large_fraction,
                    m.committed_tokens,
                    m.wall_s,
                    failed=m.failed,
                    accounting=step_accounting(list(call.events), list(r.models)),
                )
            )
            _ratios(out)
            if on_cell is not None:
                on_cell(out[-1])
            bar.update(1)
    finally:
        bar.close()
        for r in routers.values():
            r.close()
    return out


def _prompt_tokens(tokenizer, prompt) -> int:
    """Tokens of ``prompt`` as a Router encodes it by default (`tokenrouter_sdk.prompts`: the
    chat template for text when the tokenizer has one, else the text with its special tokens)."""
    if not isinstance(prompt, str):
        return len(prompt)
    from .prompts import PromptEncoder

    return len(PromptEncoder(tokenizer).encode(prompt))


def _ratios(out: list[Cell]) -> None:
    """Fill ``vs_sync`` and ``vs_no_retain`` from the cells measured so far."""
    by = {(c.policy, c.mode, c.retain_kv, c.concurrency, c.max_new_tokens): c for c in out}
    for c in out:
        s = by.get((c.policy, "sync", True, c.concurrency, c.max_new_tokens))
        nr = by.get((c.policy, c.mode, False, c.concurrency, c.max_new_tokens))
        c.vs_sync = c.throughput_tok_s / s.throughput_tok_s if s and s.throughput_tok_s else None
        c.vs_no_retain = c.throughput_tok_s / nr.throughput_tok_s if nr and nr.throughput_tok_s else None


def format_table(cells: list[Cell]) -> str:
    head = (
        f"{'policy':<11}{'mode':<11}{'kv':<6}{'N':>3}{'out':>6}{'tok/s':>9}{'lat s':>8}{'user t/s':>9}"
        f"{'hop':>7}{'large':>7}{'x sync':>8}{'x noKV':>8}{'failed':>7}  thresholds"
    )
    lines = [head, "-" * len(head)]
    for c in cells:
        f = lambda v: f"{v:8.2f}" if v is not None else f"{'-':>8}"  # noqa: E731
        lines.append(
            f"{c.policy:<11}{c.mode:<11}{'keep' if c.retain_kv else 'drop':<6}{c.concurrency:>3}"
            f"{c.max_new_tokens:>6}{c.throughput_tok_s:9.1f}{c.mean_latency_s:8.2f}{c.per_user_tok_s:9.1f}"
            f"{c.hop_rate:7.3f}{c.large_fraction:7.3f}{f(c.vs_sync)}{f(c.vs_no_retain)}"
            f"{(str(c.failed) + ' !') if c.failed else '0':>7}  {c.thresholds}"
        )
    bad = [c for c in cells if c.failed]
    if bad:
        lines.append(
            f"FAILED requests in {len(bad)} cell(s) (their throughput counts only what the others committed): "
            + ", ".join(f"{c.policy} {c.mode} N={c.concurrency}: {c.failed}" for c in bad)
        )
    return "\n".join(lines)


def format_accounting(cells: list[Cell]) -> str:
    """Where each cell's time went, one line per cell and model: steps, mean requests per step
    and their histogram, the share of the cell's wall time the model spent in steps (busy) and in
    forwards, and the steps that fed an extend or prefill beside pure decodes (with the tokens
    they fed beyond one per request)."""
    lines = []
    for c in cells:
        for model, a in c.accounting.items():
            if not a.get("steps"):
                continue
            hist = " ".join(f"{b}:{k}" for b, k in a["batch_hist"].items())
            wall = c.wall_s or float("nan")
            lines.append(
                f"{c.policy} {c.mode} {'keep' if c.retain_kv else 'drop'} N={c.concurrency} [{model}] "
                f"steps {a['steps']}, batch {a['mean_batch']:.2f} ({hist}), busy {a['step_s'] / wall:.0%} "
                f"(forward {a['forward_s'] / wall:.0%}), decode {a['decode_steps']} steps "
                f"{a['decode_s']:.2f}s, extend/prefill {a['mixed_steps']} steps {a['mixed_s']:.2f}s "
                f"(+{a['mixed_fed']} tokens)"
            )
    return "\n".join(lines)


def csv_row(cell: Cell) -> dict:
    """A cell as a CSV row (its step accounting as JSON)."""
    return {k: json.dumps(v) if isinstance(v, dict) else v for k, v in asdict(cell).items()}


def write_csv(cells: list[Cell], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(cells[0])))
        w.writeheader()
        w.writerows(csv_row(c) for c in cells)


def write_html(cells: list[Cell], path: str) -> bool:
    """A plotly chart (throughput vs concurrency per mode); False if plotly is missing."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        return False
    fig = go.Figure()
    keys = sorted({(c.policy, c.mode, c.retain_kv, c.max_new_tokens) for c in cells})
    for pol, mode, retain, new in keys:
        pts = sorted(
            (c.concurrency, c.throughput_tok_s)
            for c in cells
            if (c.policy, c.mode, c.retain_kv, c.max_new_tokens) == (pol, mode, retain, new)
        )
        fig.add_trace(
            go.Scatter(
                x=[p[0] for p in pts],
                y=[p[1] for p in pts],
                mode="lines+markers",
                name=f"{pol} {mode}{'' if retain else ' noKV'} out={new}",
            )
        )
    fig.update_layout(title="committed-token throughput", xaxis_title="concurrency", yaxis_title="tokens/s")
    fig.write_html(path, include_plotlyjs=True)
    return True


def environment() -> str:
    import torch

    load = tuple(round(x, 2) for x in os.getloadavg())
    return f"torch threads {torch.get_num_threads()}, loadavg {load}, {time.ctime()}"


class CsvLog:
    """Appends each finished `Cell` to a CSV as it comes (a run cut short keeps what it measured);
    `rewrite` writes the whole list again with the final ratios."""

    def __init__(self, path: str):
        self.path = path
        self._started = False

    def __call__(self, cell: Cell) -> None:
        with open(self.path, "a" if self._started else "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(asdict(cell)))
            if not self._started:
                w.writeheader()
            w.writerow(csv_row(cell))
        self._started = True

    def rewrite(self, cells: list[Cell]) -> None:
        if cells:
            write_csv(cells, self.path)
