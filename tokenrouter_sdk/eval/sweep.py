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
A matched reference whose realised share falls outside the central 95% sampling range of its
target (`config.binomial_range`: over committed tokens for ``random``, over questions for
``random_query``) no longer matches the point it stands beside (e.g. ``RandomQueryRouting(p=0.27)``
on 4 questions answering all 4 with the large model): its record says so (``target``,
``target_range``, ``matches_target``) and a warning names it.

Training questions: a swept policy with a learned head (`CITER`, `R2R`, `CoLLM`, `QueryRouter`)
is not scored on the questions its head's record says it was trained, validated or calibrated
on (`head_data`): they are left out of the draw before ``limit`` is taken (the next questions
in the same order take their places), the result's ``config["excluded"]`` and a warning say how
many; ``exclude_head_questions=False`` scores them anyway (``config["head_overlap"]`` then
counts them).

Resumable: with ``out_dir``, each finished point is written to ``out_dir/points/`` at once, and
a restarted run loads the points whose configuration hash matches instead of running them.

Sharded: ``shard="i/N"`` runs the i-th share of the points (each shard its own Router, process,
job or Ray task: `tokenrouter_sdk.eval.shards`) and writes a manifest to ``out_dir/shards/``;
`merge_sweep` computes what needs all points (agreement with large-only, the references' target
checks, the Pareto front and plot) and gives the same records as the unsharded sweep.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from .answers import answers_agree, answers_equal, extract_answer, extract_choice
from .config import binomial_range, config_hash, describe_policy, describe_router, library_versions, wilson_interval
from .datasets import Benchmark, load_benchmark
from .head_data import excluded_ids
from .result import EvalResult

# name -> (policy class name in tokenrouter_sdk.policies, swept parameter)
POLICIES = {"rstitch": ("RStitch", "tau"), "random": ("RandomRouting", "p"),
            "random_query": ("RandomQueryRouting", "p"), "r2r_entropy": ("R2REntropy", "threshold"),
            "r2r": ("R2R", "tau"), "citer": ("CITER", "tau"), "co_llm": ("CoLLM", "eta"),
            "query": ("QueryRouter", "threshold")}  # the last four: learned heads (the packaged ones by default)
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
        self.records, self.answers, self.policies, self.files = [], {}, {}, {}
        self.gold = bench.answers if bench.kind == "math" else [extract_choice(a) or a for a in bench.answers]

    def run(self, label: str, kind: str, policy, param: str | None, value, matched_to: str | None = None) -> dict:
        desc = describe_policy(policy)
        h = config_hash(self.common, desc, kind)
        self.policies[label] = desc
        path = self._path(label, h)
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
        self.records.append(rec)
        self.answers[label] = ans
        self.files[label] = self._path(label, rec["config_hash"])
        if self.bar is not None:
            self.bar.update(1)
        return rec

    def _path(self, label: str, h: str) -> Path | None:
        return self.points_dir / f"{_slug(label)}-{h}.json" if self.points_dir else None


def _agreement(records: list[dict], answers: dict, kind: str) -> None:
    """Each record's ``agreement`` (and each answer's ``agrees``) with the large-only point's
    answers, in place; None without a large-only point."""
    large = next((r for r in records if r["kind"] == "large_only"), None)
    if large is None:
        return
    preds = [a["pred"] for a in answers[large["label"]]]
    for rec in records:
        ans = answers[rec["label"]]
        agree = [answers_agree(a["pred"], b, kind) for a, b in zip(ans, preds)]
        for a, g in zip(ans, agree):
            a["agrees"] = g
        rec["agreement"] = sum(agree) / len(agree) if agree else None


def _reference_labels(f: float) -> dict[str, str]:
    return {"random": f"RandomRouting(p={f:g})", "random_query": f"RandomQueryRouting(p={f:g})"}


def _check_matched(rec: dict, ans: list[dict], target: float) -> None:
    """Record whether a matched reference realised its target (within the central 95% sampling
    range of its draws) and warn when it did not."""
    if rec["kind"] == "random_query":
        n = len(ans)
        share = sum(a["tokens"] > 0 and a["large_tokens"] == a["tokens"] for a in ans) / n if n else 0.0
        what, unit = "a share of questions answered by the large model of", "questions"
    else:
        n, share = rec["committed_tokens"], rec["large_fraction"]
        what, unit = "a large fraction of", "committed tokens"
    lo, hi = binomial_range(n, target)
    rec.update(target=target, realised=share, target_range=[lo, hi], matches_target=lo <= share <= hi)
    if not rec["matches_target"]:
        warnings.warn(f"reference {rec['label']} realised {what} {share:.3g} on {n} {unit}, outside the 95% "
                      f"sampling range [{lo:.3g}, {hi:.3g}] of its target {target:g} (the large fraction of "
                      f"{rec['matched_to']}): it no longer matches that point; use more questions (limit=) to "
                      f"compare at this fraction", UserWarning, stacklevel=3)


def _without(bench: Benchmark, ids: set[str]) -> Benchmark:
    """A loaded benchmark less the questions in ``ids`` (nothing takes their places)."""
    keep = [k for k, i in enumerate(bench.ids) if i not in ids]
    hit = [i for i in bench.ids if i in ids]
    extra = dict(bench.extra, excluded={"n": len(hit), "in_draw": len(hit), "draw": len(bench), "ids": hit})
    if not keep:
        raise ValueError(f"every question of the given benchmark ({len(bench)}) was used to make the policy's head; "
                         f"pass exclude_head_questions=False to score them anyway")
    return Benchmark(bench.name, bench.kind, bench.rows.select(keep), bench.source, bench.template, bench.limit,
                     bench.seed, extra)


def evaluate_policy(router_or_models, policy_factory, values: Iterable[float] = (0.02, 0.05, 0.1, 0.2, 0.4), *,
                    dataset: str | Benchmark = "gsm8k", limit: int | None = 64, seed: int | None = 0,
                    max_new_tokens: int = 256, temperature: float = 0.0, sampling_seed: int | None = 0,
                    concurrency: int | None = 16, references: bool | Iterable[str] = True, out_dir=None,
                    param: str | None = None, tokenizer=None, router_kwargs: dict | None = None,
                    progress: bool = True, exclude_head_questions: bool = True, shard=None) -> EvalResult:
    """Sweep a policy over ``values`` on a benchmark; quality next to hop rate and throughput.

    Args:
        router_or_models: a `Router` (used as is, left open), a dict name -> model (smallest
            first; give ``tokenizer``) or ``"default"``/None for `Router.default()`; a Router
            built here is closed at the end.
        policy_factory: value -> `Policy` (a callable), a Policy class (called with the value,
            as ``param=value`` when ``param`` is given), or a built-in name: ``"rstitch"`` (tau),
            ``"random"`` (p), ``"random_query"`` (p), ``"r2r_entropy"`` (threshold), and with
            their packaged heads ``"r2r"`` (tau), ``"citer"`` (tau), ``"co_llm"`` (eta),
            ``"query"`` (threshold).
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
        exclude_head_questions: leave out the questions the swept policies' learned heads were
            trained, validated or calibrated on (their records' ids; module docstring), before
            ``limit`` is taken (with a loaded `Benchmark`: just dropped). ``config["excluded"]``
            says how many; a warning too. False scores them (``config["head_overlap"]``).
        shard: run only a share of the points, for sweeps spread over workers: ``"i/N"`` (1-based)
            or ``(i, N)`` (0-based). Points are dealt round robin (large_only, small_only, then the
            swept values in order); a shard runs the matched references of its own swept points.
            Needs ``out_dir`` (the same folder for all shards, on a shared file system or copied
            together); `merge_sweep` then gives the whole sweep. Returns the shard's own points
            (agreement only where it ran large_only).

    Returns:
        an `EvalResult` (records in run order: large_only, small_only, the swept values, then the
        matched references).

    Raises:
        ValueError: no values, unknown reference names or policy, bad dataset arguments, a bad
            ``shard`` or a shard without ``out_dir``.
        TypeError: an unusable ``router_or_models`` or ``policy_factory``.
    """
    values = list(values)
    if not values:
        raise ValueError("values is empty: give at least one parameter value to sweep, e.g. values=[0.05, 0.1]")
    refs = set(REFERENCES if references is True else () if references is False else references)
    if refs - set(REFERENCES):
        raise ValueError(f"unknown references {sorted(refs - set(REFERENCES))}; choose from {list(REFERENCES)}")
    factory, pname = _factory(policy_factory, param)
    first = factory(values[0])  # its head's record decides the questions (the others are built as they run)
    head_ids, per_head = excluded_ids([first])
    drop = head_ids if exclude_head_questions else set()
    if isinstance(dataset, Benchmark):
        bench = _without(dataset, drop) if drop else dataset
    else:
        bench = load_benchmark(dataset, limit=limit, seed=seed, exclude=drop)
    excluded = overlap = None
    if drop:
        info = bench.extra["excluded"]
        excluded = {"heads": per_head, "in_draw": info["in_draw"], "draw": info["draw"], "in_benchmark": info["n"],
                    "ids": info["ids"], "rule": "questions the heads' records list as trained, validated or "
                                                "calibrated on are left out before the limit is taken"}
        if info["n"]:
            heads = " and ".join(f"{k}'s ({v} ids)" for k, v in per_head.items())
            warnings.warn(f"evaluate_policy: left out {info['in_draw']} of the {info['draw']} questions drawn from "
                          f"{bench.name} ({info['n']} in the whole benchmark) that {heads} head was trained, "
                          f"validated or calibrated on" + ("; the next questions in the same order took their "
                                                            "places" if not isinstance(dataset, Benchmark) else "")
                          + ". exclude_head_questions=False scores them anyway", UserWarning, stacklevel=2)
    elif head_ids:
        overlap = sorted(set(bench.ids) & head_ids)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": sampling_seed}
    index, n_shards = _shard(shard, out_dir)
    from ..policies import LargeOnly, RandomQueryRouting, RandomRouting, SmallOnly
    router, owned = _open_router(router_or_models, tokenizer, dict(router_kwargs or {}))
    bar = None
    try:
        common = {"router": describe_router(router), "dataset": bench.describe(), "sampling": sampling,
                  "concurrency": concurrency}
        fixed = [k for k in ("large_only", "small_only") if k in refs]
        units = fixed + [("sweep", j) for j in range(len(values))]  # shard i runs the units u with u % n == i
        mine = [u for k, u in enumerate(units) if k % n_shards == index]
        if progress:
            from tqdm.auto import tqdm
            n_swept = sum(1 for u in mine if isinstance(u, tuple))
            bar = tqdm(total=len(mine) + n_swept * (("random" in refs) + ("random_query" in refs)),
                       desc="operating points" + (f" (shard {index + 1}/{n_shards})" if n_shards > 1 else ""))
        run = _Runner(router, bench, common, sampling, concurrency, out_dir, bar)
        t0 = time.perf_counter()
        if "large_only" in mine:
            run.run("large_only", "large_only", LargeOnly(), None, None)
        if "small_only" in mine:
            run.run("small_only", "small_only", SmallOnly(), None, None)
        swept = {}
        for j, v in enumerate(values):
            if ("sweep", j) not in mine:
                continue
            pol = first if j == 0 else factory(v)
            seen = excluded_ids([pol])[0] & set(bench.ids) if j and exclude_head_questions else set()
            if seen:
                warnings.warn(f"evaluate_policy: the policy for {pname}={v:g} has a learned head of its own "
                              f"that saw {len(seen)} of the questions scored (the questions were chosen by the "
                              f"first value's head); sweep one head per call", UserWarning, stacklevel=2)
            if pname == "value" and param is None:  # name the parameter after the attribute holding v
                pname = next((k for k, a in vars(pol).items() if not k.startswith("_")
                              and isinstance(a, (int, float)) and not isinstance(a, bool) and a == v), "value")
            swept[j] = run.run(f"{type(pol).__name__}({pname}={v:g})", "sweep", pol, pname, v)
        if bar is not None:
            bar.total = len(run.records) + len(_matched(r["large_fraction"] for r in swept.values())) * (
                ("random" in refs) + ("random_query" in refs))
            bar.refresh()
        src = {round(swept[j]["large_fraction"], 3): swept[j]["label"] for j in sorted(swept, reverse=True)}
        for f in _matched(swept[j]["large_fraction"] for j in sorted(swept)):
            labels = _reference_labels(f)
            if "random" in refs:
                run.run(labels["random"], "random", RandomRouting(p=f, seed=0), "p", f, src[f])
            if "random_query" in refs:
                run.run(labels["random_query"], "random_query", RandomQueryRouting(p=f, seed=0), "p", f, src[f])
        extra = {"excluded": excluded} if excluded else {}
        if overlap is not None:
            extra["head_overlap"] = {"n": len(overlap), "ids": overlap, "heads": per_head}
        config = dict(common, **extra, policies=run.policies, swept={"param": pname, "values": values},
                      references=sorted(refs), versions=library_versions(),
                      elapsed_s=time.perf_counter() - t0, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    finally:
        if bar is not None:
            bar.close()
        if owned:
            router.close()
    if n_shards == 1:
        return _assemble(run.records, run.answers, config, bench.kind, out_dir)
    sweep_id = config_hash(common, {"values": values, "references": sorted(refs)}, "shards")
    manifest = {"shard": index, "shards": n_shards, "sweep": sweep_id, "kind": bench.kind, "config": config,
                "swept": {str(j): r["label"] for j, r in swept.items()},
                "points": {label: p.relative_to(out_dir).as_posix() for label, p in run.files.items()}}
    folder = Path(out_dir) / SHARDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"shard-{index + 1}-of-{n_shards}.json").write_text(json.dumps(manifest, default=str), encoding="utf-8")
    _agreement(run.records, run.answers, bench.kind)
    return EvalResult(run.records, dict(config, shard=[index + 1, n_shards]), run.answers)


SHARDS_DIR = "shards"


def _shard(shard, out_dir) -> tuple[int, int]:
    """``(i, n)``, 0-based, of a ``shard`` given as ``"i/n"`` (1-based, as the CLI's ``--shard``)
    or ``(i, n)`` (0-based); ``(0, 1)`` for None.

    Raises:
        ValueError: a malformed shard, or a shard without ``out_dir``.
    """
    if shard is None:
        return 0, 1
    if isinstance(shard, str):
        a, _, b = shard.partition("/")
        try:
            i, n = int(a) - 1, int(b)
        except ValueError:
            raise ValueError(f"shard must be 'i/N' with 1 <= i <= N, e.g. '1/4', got {shard!r}") from None
    else:
        i, n = shard
    if not (isinstance(i, int) and isinstance(n, int) and n >= 1 and 0 <= i < n):
        raise ValueError(f"shard must be 'i/N' with 1 <= i <= N (or (i, N) with 0 <= i < N), got {shard!r}")
    if n > 1 and out_dir is None:
        raise ValueError("a shard writes its points for the merge: give out_dir (the same folder for every shard)")
    return i, n


def _assemble(records: list[dict], answers: dict, config: dict, kind: str, out_dir) -> EvalResult:
    """The result of a whole sweep from its points in run order: agreement with large-only and
    the matched references checked against their targets; saved to ``out_dir``."""
    _agreement(records, answers, kind)
    for rec in records:
        if rec["kind"] in ("random", "random_query"):
            _check_matched(rec, answers[rec["label"]], rec["value"])
    res = EvalResult(records, config, answers)
    if out_dir is not None:
        res.save(out_dir)
    return res


def merge_sweep(out_dir) -> EvalResult:
    """Merge the shards of one sweep (each run by ``evaluate_policy(..., shard=...)`` or
    ``tokenrouter eval --shard i/N`` into ``out_dir``) into the result the unsharded sweep gives:
    the same records in the same order (timings and prefix-cache counts are each shard's own;
    ``config["elapsed_s"]`` is their sum), agreement with large-only and the references' target
    checks computed over all points. Saves it to ``out_dir`` (results.csv/json, plot.html).

    Raises:
        FileNotFoundError: no shard manifests in ``out_dir``, a shard not finished or a point
            file missing (names it).
        ValueError: shards of different sweeps in one folder.
    """
    folder = Path(out_dir) / SHARDS_DIR
    manifests = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("shard-*-of-*.json"))]
    if not manifests:
        raise FileNotFoundError(f"no shard manifests in {folder}: run each shard with --shard i/N --out {out_dir}")
    n, sweep = manifests[0]["shards"], manifests[0]["sweep"]
    if any(m["shards"] != n or m["sweep"] != sweep for m in manifests):
        raise ValueError(f"{folder} holds shards of different sweeps (other models, data, sampling, values or "
                         f"shard count); give each sweep its own --out folder")
    missing = sorted(set(range(1, n + 1)) - {m["shard"] + 1 for m in manifests})
    if missing:
        raise FileNotFoundError(f"shard(s) {missing} of {n} have not finished in {out_dir} (run them with "
                                f"--shard i/{n})")
    recs, answers, policies = {}, {}, {}
    for m in manifests:
        policies.update(m["config"].get("policies", {}))
        for label, rel in m["points"].items():
            path = Path(out_dir) / rel
            if not path.is_file():
                raise FileNotFoundError(f"point {label!r} of shard {m['shard'] + 1} is missing: {path}")
            saved = json.loads(path.read_text(encoding="utf-8"))
            recs[label], answers[label] = saved["record"], saved["answers"]
    first = manifests[0]["config"]
    refs = first["references"]
    swept_labels = {int(j): label for m in manifests for j, label in m["swept"].items()}
    swept = [swept_labels[j] for j in sorted(swept_labels)]
    order = [k for k in ("large_only", "small_only") if k in refs] + swept
    for f in _matched(recs[label]["large_fraction"] for label in swept):
        order += [_reference_labels(f)[k] for k in ("random", "random_query") if k in refs]
    src = {round(recs[label]["large_fraction"], 3): label for label in reversed(swept)}
    records = [recs[label] for label in order]
    for rec in records:  # the point a reference stands beside, as one run over all points names it
        if rec["kind"] in ("random", "random_query"):
            rec["matched_to"] = src[round(rec["value"], 3)]
    config = {k: v for k, v in first.items() if k not in ("elapsed_s", "finished", "policies")}
    config.update(policies={label: policies[label] for label in order if label in policies},
                  elapsed_s=sum(m["config"]["elapsed_s"] for m in manifests), shards=n,
                  finished=max(m["config"]["finished"] for m in manifests))
    return _assemble(records, {label: answers[label] for label in order}, config, manifests[0]["kind"], out_dir)
