"""`evaluate_policy`: sweep a policy's threshold on a benchmark and report quality next to cost.

Every operating point runs the same prompts through the same `Router` with the same sampling,
and is measured by `Router.metrics` (committed tokens only; docs/metrics.md). Reference
points in the same run (the comparisons every routing paper plots, e.g. R2R arXiv 2505.21600
section 5 and RouteLLM arXiv 2406.18665 section 5):
- ``large_only`` and ``small_only``;
- ``random``: `RandomRouting` (token level) with p = the large fraction realized by each
  swept point (RandomRouting's large fraction equals p, see `tokenrouter_sdk.bench`);
- ``random_query``: `RandomQueryRouting` (query level) with the same p (share of requests
  answered by the large model).
Resumable: with ``out_dir``, each finished point is written to ``out_dir/points/`` at once, and
a restarted run loads the points whose configuration hash matches instead of running them.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from .answers import answers_agree, answers_equal, extract_answer, extract_choice
from .config import config_hash, describe_policy, describe_router, library_versions, wilson_interval
from .datasets import Benchmark, load_benchmark
from .result import EvalResult

# name -> (policy class name in tokenrouter_sdk.policies, swept parameter)
POLICIES = {"rstitch": ("RStitch", "tau"), "random": ("RandomRouting", "p"),
            "random_query": ("RandomQueryRouting", "p"), "r2r_entropy": ("R2REntropy", "threshold")}
REFERENCES = ("large_only", "small_only", "random", "random_query")


def policy_factory_for(name: str) -> tuple[Callable[[float], Any], str]:
    """(factory value -> policy, parameter name) for a built-in policy name (see ``POLICIES``).

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    key = name.lower().replace("-", "_")
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; sweepable built-ins: {', '.join(POLICIES)} "
                         f"(or pass a callable value -> Policy)")
    from .. import policies
    cls_name, param = POLICIES[key]
    cls = getattr(policies, cls_name)
    return (lambda v: cls(**{param: v})), param


def _factory(policy_factory, param: str | None) -> tuple[Callable[[float], Any], str]:
    if isinstance(policy_factory, str):
        f, p = policy_factory_for(policy_factory)
        return f, param or p
    if isinstance(policy_factory, type):
        cls = policy_factory
        return ((lambda v: cls(**{param: v})) if param else (lambda v: cls(v))), param or "value"
    if callable(policy_factory):
        return policy_factory, param or "value"
    raise TypeError(f"policy_factory must be a policy name, a Policy class or a callable value -> Policy, "
                    f"got {type(policy_factory).__name__}")


def _open_router(router_or_models, tokenizer, router_kwargs: dict):
    """(router, whether we own it and must close it)."""
    from ..router import Router
    if isinstance(router_or_models, Router):
        if router_kwargs:
            raise ValueError("router_kwargs apply only when evaluate_policy builds the Router; "
                             "set them on your Router instead")
        return router_or_models, False
    if router_or_models is None or router_or_models == "default":
        return Router.default(**router_kwargs), True
    if isinstance(router_or_models, dict):
        return Router(router_or_models, tokenizer=tokenizer, **router_kwargs), True
    raise TypeError(f"router_or_models must be a Router, a dict name -> model (smallest first) or 'default', "
                    f"got {type(router_or_models).__name__}")


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", s)[:60]


def _matched(fractions: Iterable[float]) -> list[float]:
    """Distinct large fractions (3 decimals) strictly between 0 and 1, in order of appearance."""
    out = []
    for f in fractions:
        f = round(float(f), 3)
        if 0.0 < f < 1.0 and f not in out:
            out.append(f)
    return out


class _Runner:
    """Runs and records operating points on one router and benchmark."""

    def __init__(self, router, bench: Benchmark, common: dict, sampling: dict, concurrency, out_dir, bar):
        self.router, self.bench, self.common, self.sampling = router, bench, common, sampling
        self.concurrency, self.bar = concurrency, bar
        self.points_dir = Path(out_dir) / "points" if out_dir is not None else None
        self.records, self.answers, self.policies = [], {}, {}
        self.large_preds: list | None = None
        self.gold = bench.answers if bench.kind == "math" else [extract_choice(a) or a for a in bench.answers]

    def run(self, label: str, kind: str, policy, param: str | None, value, matched_to: str | None = None) -> dict:
        desc = describe_policy(policy)
        h = config_hash(self.common, desc, kind)
        self.policies[label] = desc
        path = self.points_dir / f"{_slug(label)}-{h}.json" if self.points_dir else None
        if path is not None and path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("config_hash") == h:
                rec, ans = saved["record"], saved["answers"]
                rec["resumed"] = True
                return self._add(label, kind, rec, ans)
        if self.bar is not None:
            self.bar.set_postfix_str(label)
        outs = self.router.generate(self.bench.prompts, policy=policy, concurrency=self.concurrency, **self.sampling)
        m = self.router.metrics()
        large = list(self.router.models)[-1]
        kindq = self.bench.kind
        ans = []
        for qid, out, gold in zip(self.bench.ids, outs, self.gold):
            text = out.text if out.ok else None
            pred = extract_answer(text, kindq)
            ans.append({"id": qid, "text": text, "pred": pred, "correct": answers_equal(pred, gold, kindq),
                        "tokens": len(out.token_ids), "large_tokens": out.token_models.count(large),
                        "hops": out.hops, "finish_reason": out.finish_reason, "error": out.error})
        n, k = len(ans), sum(a["correct"] for a in ans)
        lo, hi = wilson_interval(k, n)
        rec = {"label": label, "kind": kind, "policy": type(policy).__name__, "param": param, "value": value,
               "n": n, "correct": k, "accuracy": k / n if n else 0.0, "acc_ci_low": lo, "acc_ci_high": hi,
               "agreement": None, "answered": sum(a["pred"] is not None for a in ans) / n if n else 0.0,
               "hop_rate": m.hop_rate, "large_fraction": m.large_fraction, "throughput_tok_s": m.throughput_tok_s,
               "mean_latency_s": m.mean_latency_s, "tokens_per_answer": m.committed_tokens / n if n else 0.0,
               "committed_tokens": m.committed_tokens, "wall_s": m.wall_s, "hops": m.hops,
               "discarded_tokens": m.discarded_tokens, "failed": m.failed, "matched_to": matched_to,
               "prompt_tokens": sum(x.prefix_query_tokens for x in m.per_model.values()),
               "prefix_hit_tokens": sum(x.prefix_hit_tokens for x in m.per_model.values()),
               "config_hash": h, "resumed": False}
        rec["prompt_tokens_fed"] = rec["prompt_tokens"] - rec["prefix_hit_tokens"]
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"config_hash": h, "policy": desc, "record": rec, "answers": ans},
                                      default=str), encoding="utf-8")
            tmp.replace(path)
        return self._add(label, kind, rec, ans)

    def _add(self, label: str, kind: str, rec: dict, ans: list[dict]) -> dict:
        if kind == "large_only":
            self.large_preds = [a["pred"] for a in ans]
        if self.large_preds is not None:
            agree = [answers_agree(a["pred"], b, self.bench.kind) for a, b in zip(ans, self.large_preds)]
            for a, g in zip(ans, agree):
                a["agrees"] = g
            rec["agreement"] = sum(agree) / len(agree) if agree else None
        self.records.append(rec)
        self.answers[label] = ans
        if self.bar is not None:
            self.bar.update(1)
        return rec


def evaluate_policy(router_or_models, policy_factory, values: Iterable[float] = (0.02, 0.05, 0.1, 0.2, 0.4), *,
                    dataset: str | Benchmark = "gsm8k", limit: int | None = 64, seed: int | None = 0,
                    max_new_tokens: int = 256, temperature: float = 0.0, sampling_seed: int | None = 0,
                    concurrency: int | None = 16, references: bool | Iterable[str] = True, out_dir=None,
                    param: str | None = None, tokenizer=None, router_kwargs: dict | None = None,
                    progress: bool = True) -> EvalResult:
    """Sweep a policy over ``values`` on a benchmark; quality next to hop rate and throughput.

    Args:
        router_or_models: a `Router` (used as is, left open), a dict name -> model (smallest
            first; give ``tokenizer``) or ``"default"``/None for `Router.default()`; a Router
            built here is closed at the end.
        policy_factory: value -> `Policy` (a callable), a Policy class (called with the value,
            as ``param=value`` when ``param`` is given), or a built-in name: ``"rstitch"`` (tau),
            ``"random"`` (p), ``"random_query"`` (p), ``"r2r_entropy"`` (threshold).
        values: the swept parameter values, one operating point each.
        dataset: a benchmark name or JSONL path (see `load_benchmark`) or a loaded `Benchmark`.
        limit, seed: the subset (``seed`` None: the first ``limit`` questions).
        max_new_tokens, temperature, sampling_seed: sampling (default greedy).
        concurrency: requests in flight per point (None: all questions at once).
        references: True for all of ``large_only``, ``small_only``, ``random`` (RandomRouting at
            the matched large fractions), ``random_query`` (RandomQueryRouting, matched), False
            for none, or an iterable of those names. ``agreement`` needs ``large_only``.
        out_dir: folder for resumable per-point files (``points/``) and the final
            ``results.csv``, ``results.json`` and ``plot.html``.
        param: the swept parameter's name (for labels and the class form of ``policy_factory``).
        tokenizer: the shared tokenizer when ``router_or_models`` is a dict of model objects.
        router_kwargs: `Router` keyword arguments when the Router is built here.
        progress: a tqdm progress bar over operating points.

    Returns:
        an `EvalResult` (records in run order: large_only, small_only, the swept values, then the
        matched references).

    Raises:
        ValueError: no values, unknown reference names or policy, bad dataset arguments.
        TypeError: an unusable ``router_or_models`` or ``policy_factory``.
    """
    values = list(values)
    if not values:
        raise ValueError("values is empty: give at least one parameter value to sweep, e.g. values=[0.05, 0.1]")
    refs = set(REFERENCES if references is True else () if references is False else references)
    if refs - set(REFERENCES):
        raise ValueError(f"unknown references {sorted(refs - set(REFERENCES))}; choose from {list(REFERENCES)}")
    factory, pname = _factory(policy_factory, param)
    bench = dataset if isinstance(dataset, Benchmark) else load_benchmark(dataset, limit=limit, seed=seed)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": sampling_seed}
    from ..policies import LargeOnly, RandomQueryRouting, RandomRouting, SmallOnly
    router, owned = _open_router(router_or_models, tokenizer, dict(router_kwargs or {}))
    bar = None
    try:
        common = {"router": describe_router(router), "dataset": bench.describe(), "sampling": sampling,
                  "concurrency": concurrency}
        if progress:
            from tqdm.auto import tqdm
            n_est = len(values) * (1 + ("random" in refs) + ("random_query" in refs))
            bar = tqdm(total=n_est + ("large_only" in refs) + ("small_only" in refs), desc="operating points")
        run = _Runner(router, bench, common, sampling, concurrency, out_dir, bar)
        t0 = time.perf_counter()
        if "large_only" in refs:
            run.run("large_only", "large_only", LargeOnly(), None, None)
        if "small_only" in refs:
            run.run("small_only", "small_only", SmallOnly(), None, None)
        swept = []
        for v in values:
            pol = factory(v)
            if pname == "value" and param is None:  # name the parameter after the attribute holding v
                pname = next((k for k, a in vars(pol).items() if not k.startswith("_")
                              and isinstance(a, (int, float)) and not isinstance(a, bool) and a == v), "value")
            swept.append(run.run(f"{type(pol).__name__}({pname}={v:g})", "sweep", pol, pname, v))
        fracs = _matched(r["large_fraction"] for r in swept)
        if bar is not None:
            bar.total = len(run.records) + len(fracs) * (("random" in refs) + ("random_query" in refs))
            bar.refresh()
        src = {round(r["large_fraction"], 3): r["label"] for r in reversed(swept)}
        for f in fracs:
            if "random" in refs:
                run.run(f"RandomRouting(p={f:g})", "random", RandomRouting(p=f, seed=0), "p", f, src[f])
            if "random_query" in refs:
                run.run(f"RandomQueryRouting(p={f:g})", "random_query", RandomQueryRouting(p=f, seed=0), "p", f, src[f])
        config = dict(common, policies=run.policies, swept={"param": pname, "values": values},
                      references=sorted(refs), versions=library_versions(),
                      elapsed_s=time.perf_counter() - t0, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    finally:
        if bar is not None:
            bar.close()
        if owned:
            router.close()
    res = EvalResult(run.records, config, run.answers)
    if out_dir is not None:
        res.save(out_dir)
    return res
