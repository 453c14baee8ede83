"""`evaluate_policy` / `evaluate_policies`: sweep policies' thresholds on a benchmark and report
quality next to cost, with references a reader can compare against.

Every operating point runs the same prompts through the same `Router` with the same sampling.
Reference points in the same run (the comparisons routing papers plot, e.g. R2R arXiv
2505.21600 section 5 and RouteLLM arXiv 2406.18665 section 5): ``large_only``, ``small_only``,
and beside every swept point with a large fraction strictly between 0 and 1 the matched random
references of `tokenrouter_sdk.eval.references`: ``random`` (per token), ``random_span``
(matched on the large fraction and on the mean visit length on each model, hence on the hop
rate) and ``random_query`` (per question). A reference whose realised share falls outside the
central 95% sampling range of its target says so (``target``, ``target_range``,
``matches_target``) and a warning names it; one that cannot run is listed in
``config["skipped_references"]`` and under the table.

A failed request is never a result: accuracy, agreement, hop rate, large fraction and
throughput are computed over the *answered* requests (those that did not fail or abort);
``answered`` and ``failed`` count them, a point with failures is ``flagged``, and a note under
the table gives its first error.

Timing protocol (``repeats``, ``cache``): the engine is warmed once (a few prompts on both models,
untimed); then every point, references included, is timed ``repeats`` times in interleaved
order: all points once, then all points again in the reverse order (and so on), so drifts of the
machine's speed fall on every point alike. Before each timed run the prefix cache of every model
is cleared (``cache="clear"``, the default): each run starts from the state of a new Router, as a
new batch of questions would; a warm cache would instead let a later point reuse the prompts
(and, for a routed point, the large model's first-visit prefill of prompt + output) that earlier
points or its own earlier repeat left there, which favours whichever point runs later.
``cache="keep"`` times the points as they come. Throughput is the median over the repeats of
committed tokens of answered requests / seconds from first admission to last finish, with the
spread (min, max) beside it; ``tok_per_cpu_s`` is committed tokens per CPU-second of this
process and its descendants (the sub-servers); the machine's load during the timed runs
(`tokenrouter_sdk.eval.machine`) is recorded with the result, and a warning and a note say when
other processes used more than 10% of the CPUs. Answers come from the first repeat; later
repeats that wrote other tokens are counted (``repeat_mismatches``).

Training questions: a swept policy with a learned head (`CITER`, `R2R`, `CoLLM`, `QueryRouter`)
is not scored on the questions its head's record says it was trained, validated or calibrated
on (`head_data`). With several policies the union of every head's questions is left out, so every
policy and reference is scored on one question set. They are left out of the draw before
``limit`` is taken (the next questions in the same order take their places); the result's
``config["excluded"]`` and a warning say how many; ``exclude_head_questions=False`` scores them
anyway (``config["head_overlap"]`` then counts them).

Paired statistics on the same questions (`tokenrouter_sdk.eval.stats`): for every swept point,
bootstrap intervals of its accuracy and agreement differences with small-only, large-only and its
matched references (``res.paired``), and per policy RouteLLM's APGR and the large fraction that
reaches 50% and 80% of the large-only gain (``res.summaries``).

Resumable: with ``out_dir``, each point's file in ``out_dir/points/`` is written after each of its
runs; a restarted run loads the points whose configuration hash matches and runs only the
repeats they lack.

Sharded: ``shard="i/N"`` runs the i-th share of the points (each shard its own Router, process,
job or Ray task: `tokenrouter_sdk.eval.shards`) and writes a manifest to ``out_dir/shards/``;
`merge_sweep` computes what needs all points and gives the same records as the unsharded sweep
(timings are each shard's own).
"""

from __future__ import annotations

import json
import re
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .answers import answers_equal, extract_answer, extract_choice
from .calibrate import CALIBRATION_QUESTIONS, calibrate_entries, check_targets
from .config import config_hash, describe_policy, describe_router, library_versions, wilson_interval
from .datasets import Benchmark, load_benchmark
from .head_data import excluded_ids
from .machine import CpuWindow, load_summary
from .references import KINDS as MATCHED
from .references import check_reference, matched_references
from .result import EvalResult
from .stats import gain_summary, mean_visits, paired_bootstrap, token_agreement, visit_counts, visits_from_trace

# name -> (policy class name in tokenrouter_sdk.policies, swept parameter)
POLICIES = {
    "rstitch": ("RStitch", "tau"),
    "random": ("RandomRouting", "p"),
    "random_query": ("RandomQueryRouting", "p"),
    "r2r_entropy": ("R2REntropy", "threshold"),
    "r2r": ("R2R", "tau"),
    "citer": ("CITER", "tau"),
    "co_llm": ("CoLLM", "eta"),
    "query": ("QueryRouter", "threshold"),
}  # the last four: learned heads (the packaged ones by default)
TRAINING_FREE = ("rstitch", "random", "random_query", "r2r_entropy")
DEFAULT_VALUES = (0.02, 0.05, 0.1, 0.2, 0.4)  # the training-free policies' default sweep (the CLI's too)
REFERENCES = ("large_only", "small_only", "random", "random_span", "random_query")
CACHE_MODES = ("clear", "keep")
TIMING_KEYS = (
    "repeats",
    "throughput_tok_s",
    "throughput_runs",
    "throughput_min",
    "throughput_max",
    "throughput_spread",
    "wall_s",
    "mean_latency_s",
    "tok_per_cpu_s",
    "cpu_s",
    "other_share",
    "prompt_tokens",
    "prefix_hit_tokens",
    "prompt_tokens_fed",
    "prompt_fed_runs",
    "repeat_mismatches",
    "resumed",
)
"""Record keys that are measurements of time and of the cache state a run met (they differ between
two runs of the same sweep; everything else is a function of the answers)."""
DEFAULT_REPEATS = 2
WARMUP_PROMPTS, WARMUP_TOKENS = 4, 8


def policy_factory_for(name: str) -> tuple[Callable[[float], Any], str]:
    """(factory value -> policy, parameter name) for a built-in policy name (see ``POLICIES``).

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    key = name.lower().replace("-", "_")
    if key not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; sweepable built-ins: {', '.join(POLICIES)} (or pass a callable value -> Policy)"
        )
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
    raise TypeError(
        f"policy_factory must be a policy name, a Policy class or a callable value -> Policy, "
        f"got {type(policy_factory).__name__}"
    )


def default_values(policy_factory, param: str | None = None) -> list[float]:
    """The values a sweep runs when none are given, as ``tokenrouter eval`` does: 0.02, 0.05, 0.1,
    0.2, 0.4 for the training-free built-ins (``rstitch``, ``random``, ``random_query``,
    ``r2r_entropy``); one point at the policy's own value for the learned ones (``r2r``,
    ``citer``, ``co_llm``, ``query``: the head's calibrated threshold) and for a Policy class
    whose default instance has a number ``param``.

    Raises:
        ValueError: a callable, or a class without a default number for ``param``: give values.
    """
    if isinstance(policy_factory, str):
        key = policy_factory.lower().replace("-", "_")
        if key in TRAINING_FREE:
            return list(DEFAULT_VALUES)
        from .. import policies

        cls_name, p = POLICIES.get(key, (None, None))
        if cls_name is None:
            policy_factory_for(policy_factory)  # raises, naming the known ones
        policy_factory, param = getattr(policies, cls_name), param or p
    if isinstance(policy_factory, type) and param:
        try:
            v = getattr(policy_factory(), param, None)
        except TypeError:
            v = None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return [v]
    raise ValueError(
        f"give values for {getattr(policy_factory, '__name__', policy_factory)!r}: only the built-in "
        f"names and Policy classes with a default {param or 'parameter'} have default values"
    )


@dataclass
class _Entry:
    """One swept policy: its name (None: named after its class), factory, parameter and values."""

    name: str | None
    factory: Callable[[float], Any]
    param: str
    values: list
    explicit_param: bool = True
    first: Any = None
    label_param: str = ""


def _entry(name: str | None, spec, values=None, param: str | None = None) -> _Entry:
    """An `_Entry` from ``spec``: a policy factory (a built-in name, a Policy class, a callable
    value -> Policy), a tuple ``(factory, values)`` / ``(factory, values, param)``, a dict
    with ``policy``, ``values`` and ``param``, or a `Policy` instance (one point, as it is,
    labelled by its name)."""
    from ..policy import Policy

    if isinstance(spec, Policy):
        if values is not None or param is not None:
            raise ValueError(
                f"policy {name or type(spec).__name__!r} is an instance: it runs as one point as it is; "
                f"give a factory (a class or value -> Policy) to sweep values"
            )
        return _Entry(name, lambda v, _p=spec: _p, None, [None], explicit_param=False)
    if isinstance(spec, Mapping):
        spec, values, param = spec.get("policy"), spec.get("values", values), spec.get("param", param)
    elif isinstance(spec, tuple):
        if not 1 <= len(spec) <= 3:
            raise TypeError(f"a policy given as a tuple is (factory, values) or (factory, values, param), got {spec!r}")
        values = spec[1] if len(spec) > 1 else values
        param = spec[2] if len(spec) > 2 else param
        spec = spec[0]
    factory, pname = _factory(spec, param)
    values = default_values(spec, pname if pname != "value" else None) if values is None else list(values)
    if not values:
        raise ValueError("values is empty: give at least one parameter value to sweep, e.g. values=[0.05, 0.1]")
    return _Entry(name, factory, pname, values, explicit_param=param is not None)


def _open_router(router_or_models, tokenizer, router_kwargs: dict):
    """(router, whether we own it and must close it)."""
    from ..router import Router

    if isinstance(router_or_models, Router):
        if router_kwargs:
            raise ValueError(
                "router_kwargs apply only when evaluate_policy builds the Router; set them on your Router instead"
            )
        return router_or_models, False
    if router_or_models is None or router_or_models == "default":
        return Router.default(**router_kwargs), True
    if isinstance(router_or_models, dict):
        return Router(router_or_models, tokenizer=tokenizer, **router_kwargs), True
    raise TypeError(
        f"router_or_models must be a Router, a dict name -> model (smallest first) or 'default', "
        f"got {type(router_or_models).__name__}"
    )


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", s)[:60]


def _runs(models: list[str]) -> list[list]:
    """``[model, tokens]`` runs of consecutive tokens by one model (the visits when no trace is
    at hand)."""
    out: list[list] = []
    for m in models:
        if out and out[-1][0] == m:
            out[-1][1] += 1
        else:
            out.append([m, 1])
    return out


@dataclass
class _Point:
    label: str
    kind: str
    policy: Any
    param: str | None
    value: Any
    matched_to: str | None = None
    policy_name: str | None = None
    targets: dict | None = None
    matched_points: list = field(default_factory=list)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class _Runner:
    """Runs, times and records the operating points on one router and benchmark."""

    def __init__(
        self,
        router,
        bench: Benchmark,
        common: dict,
        sampling: dict,
        concurrency,
        out_dir,
        bar,
        cache: str,
        deferred: list,
    ):
        self.router, self.bench, self.common, self.sampling = router, bench, common, sampling
        self.concurrency, self.bar, self.cache, self.deferred = concurrency, bar, cache, deferred
        self.points_dir = Path(out_dir) / "points" if out_dir is not None else None
        self.large = list(router.models)[-1]
        self.sim = router.config.backend == "sim"
        self.records: dict[str, dict] = {}
        self.answers: dict[str, list] = {}
        self.runs: dict[str, list] = {}
        self.points: dict[str, _Point] = {}
        self.order: list[str] = []
        self.policies, self.files = {}, {}
        self.log: list[list] = []  # [repeat, label] of each timed run, in the order they ran
        self.session_runs: list[dict] = []  # the runs timed in this session (not resumed ones)
        self._warm = False
        self._visits: dict = {}  # rid -> [model, tokens] visits of the last timed run
        self.gold = bench.answers if bench.kind == "math" else [extract_choice(a) or a for a in bench.answers]

    # -- running -----------------------------------------------------------------------------
    def _warmup(self) -> None:
        """One untimed run of a few prompts on both models (first calls allocate, build kernels,
        fill allocator caches), then an empty prefix cache."""
        self._warm = True
        from ..policies import RandomRouting

        n = min(WARMUP_PROMPTS, len(self.bench.prompts))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.router.generate(
                self.bench.prompts[:n],
                policy=RandomRouting(p=0.5, seed=0),
                concurrency=n,
                **dict(self.sampling, max_new_tokens=min(WARMUP_TOKENS, self.sampling["max_new_tokens"])),
            )
        if self.cache == "clear":
            self.router.clear_prefix_cache()

    def _timed(self, pt: _Point, repeat: int):
        if not self._warm:
            self._warmup()
        if self.cache == "clear":
            self.router.clear_prefix_cache()
        if self.bar is not None:
            self.bar.set_postfix_str(f"{pt.label} (run {repeat + 1})")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with CpuWindow() as win:
                outs = self.router.generate(
                    self.bench.prompts, policy=pt.policy, concurrency=self.concurrency, **self.sampling
                )
        for w in caught:  # shown after the progress bar; failed requests are reported by the sweep itself
            if "requests failed" not in str(w.message):
                self.deferred.append((w.category, f"{pt.label}: {w.message}"))
        m = self.router.metrics()
        self._visits = visits_from_trace(self.router.trace, [o.rid for o in outs])
        ok = [o for o in outs if o.ok]
        tok = sum(len(o.token_ids) for o in ok)
        mach = win.record()
        run = {
            "repeat": repeat,
            "seq": len(self.log),
            "wall_s": m.wall_s,
            "throughput_tok_s": tok / m.wall_s if ok and m.wall_s > 0 else None,
            "committed_tokens": tok,
            "mean_latency_s": statistics.fmean(o.latency_s or 0.0 for o in ok) if ok else None,
            "tok_per_cpu_s": (
                tok / mach["cpu_s"] if ok and not self.sim and mach["cpu_s"] and mach["cpu_s"] > 0 else None
            ),  # simulated seconds are not CPU seconds
            "prompt_tokens": sum(x.prefix_query_tokens for x in m.per_model.values()),
            "prefix_hit_tokens": sum(x.prefix_hit_tokens for x in m.per_model.values()),
            "prompt_fed": {n: x.prefix_query_tokens - x.prefix_hit_tokens for n, x in m.per_model.items()},
            "tokens_hash": config_hash([list(o.token_ids) for o in outs]),
            **mach,
        }
        self.log.append([repeat, pt.label])
        self.session_runs.append(run)
        if self.bar is not None:
            self.bar.update(1)
        return outs, run

    def first(self, pt: _Point) -> dict:
        """Run (or load) the first repeat of ``pt``; its record."""
        desc = describe_policy(pt.policy)
        h = config_hash(self.common, desc, pt.kind)
        self.policies[pt.label] = desc
        self.points[pt.label] = pt
        path = self._path(pt.label, h)
        self.files[pt.label] = path
        found = self._saved(path, h)
        if found is not None:
            saved, was = found
            rec, ans, runs = saved["record"], saved["answers"], saved["runs"]
            rec.update(resumed=True, label=pt.label, policy_name=pt.policy_name, param=pt.param, value=pt.value)
            self._keep(pt, rec, ans, runs)
            if was != path:  # saved under another label (the same configuration): it moves to this one
                self._save(pt.label)
                was.unlink()
            if self.bar is not None:
                self.bar.update(len(runs))
            return rec
        outs, run = self._timed(pt, 0)
        ans = self._answers(outs, self._visits)
        rec = self._record(pt, ans, h)
        self._keep(pt, rec, ans, [run])
        self._save(pt.label)
        return rec

    def again(self, label: str, repeat: int) -> None:
        """Run repeat ``repeat`` of a point unless its saved runs have it."""
        if len(self.runs[label]) > repeat:
            return
        outs, run = self._timed(self.points[label], repeat)
        self.runs[label].append(run)
        _timing(self.records[label], self.runs[label])
        self._save(label)

    def _keep(self, pt: _Point, rec: dict, ans: list, runs: list) -> None:
        if pt.label not in self.records:
            self.order.append(pt.label)
        rec.update(matched_to=pt.matched_to, targets=pt.targets, matched_points=list(pt.matched_points) or None)
        self.records[pt.label], self.answers[pt.label], self.runs[pt.label] = rec, ans, runs
        _timing(rec, runs)

    def _save(self, label: str) -> None:
        path = self.files.get(label)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        rec = self.records[label]
        tmp.write_text(
            json.dumps(
                {
                    "config_hash": rec["config_hash"],
                    "policy": self.policies[label],
                    "record": rec,
                    "answers": self.answers[label],
                    "runs": self.runs[label],
                },
                default=str,
            ),
            encoding="utf-8",
        )
        tmp.replace(path)

    def _path(self, label: str, h: str) -> Path | None:
        return self.points_dir / f"{_slug(label)}-{h}.json" if self.points_dir else None

    def _saved(self, path: Path | None, h: str) -> tuple[dict, Path] | None:
        """The saved point of configuration ``h`` with at least one run, and its file: ``path``,
        else a file of the same configuration saved under another label (a point's label is
        its policy's name, which differs between a one-policy and a several-policy sweep)."""
        if path is None:
            return None
        for f in [path, *sorted(self.points_dir.glob(f"*-{h}.json"))]:
            if f.is_file():
                saved = json.loads(f.read_text(encoding="utf-8"))
                if saved.get("config_hash") == h and saved.get("runs"):
                    return saved, f
        return None

    # -- recording ---------------------------------------------------------------------------
    def _answers(self, outs, visits: dict) -> list[dict]:
        kindq, ans = self.bench.kind, []
        for qid, out, gold in zip(self.bench.ids, outs, self.gold):
            text = out.text if out.ok else None
            pred = extract_answer(text, kindq) if out.ok else None
            ans.append(
                {
                    "id": qid,
                    "ok": out.ok,
                    "text": text,
                    "pred": pred,
                    "correct": bool(out.ok and answers_equal(pred, gold, kindq)),
                    "tokens": len(out.token_ids),
                    "large_tokens": out.token_models.count(self.large),
                    "hops": out.hops,
                    "writer_changes": out.writer_changes,
                    "finish_reason": out.finish_reason,
                    "error": out.error if not out.ok else None,
                    "token_ids": list(out.token_ids),
                    "visits": visits.get(out.rid) or _runs(out.token_models),
                }
            )
        return ans

    def _record(self, pt: _Point, ans: list[dict], h: str) -> dict:
        rec = record_of(ans, self.large)
        rec.update(
            label=pt.label,
            kind=pt.kind,
            policy=type(pt.policy).__name__,
            policy_name=pt.policy_name,
            param=pt.param,
            value=pt.value,
            config_hash=h,
            resumed=False,
        )
        return rec


def record_of(ans: list[dict], large: str) -> dict:
    """A point's quality and routing numbers from its answers, over the answered requests (those
    that did not fail or abort): ``n``, ``answered``, ``failed``, ``correct``, ``accuracy`` and its
    Wilson 95% interval (None without an answered request), ``extracted`` (share of answered
    requests with a final answer found), ``hops``, ``hop_rate``, ``writer_changes``,
    ``writer_change_rate``, ``large_fraction``, ``mean_large_visit``, ``mean_small_visit``
    (`stats.mean_visits`), ``tokens_per_answer``, ``committed_tokens``, ``flagged`` and
    ``first_error``. An answered request without an extracted answer is never correct
    (``no_answer``: their share, ``1 - extracted``)."""
    ok = [a for a in ans if a.get("ok", a.get("error") is None)]
    n, m = len(ans), len(ok)
    k = sum(bool(a["correct"]) for a in ok)
    lo, hi = wilson_interval(k, m) if m else (None, None)
    tokens = sum(a["tokens"] for a in ok)
    vis = mean_visits([visit_counts(a.get("visits") or [], large) for a in ok])
    errors = [a["error"] for a in ans if a not in ok and a.get("error")]
    return {
        "n": n,
        "answered": m,
        "failed": n - m,
        "correct": k,
        "accuracy": k / m if m else None,
        "acc_ci_low": lo,
        "acc_ci_high": hi,
        "agreement": None,
        "agreement_n": 0,
        "token_agreement_prefix": None,
        "token_agreement": None,
        "extracted": sum(a["pred"] is not None for a in ok) / m if m else None,
        "no_answer": sum(a["pred"] is None for a in ok) / m if m else None,
        "hops": sum(a["hops"] for a in ok),
        "hop_rate": sum(a["hops"] for a in ok) / tokens if tokens else None,
        "writer_changes": sum(a.get("writer_changes", 0) for a in ok),
        "writer_change_rate": sum(a.get("writer_changes", 0) for a in ok) / tokens if tokens else None,
        "large_fraction": sum(a["large_tokens"] for a in ok) / tokens if tokens else None,
        "mean_large_visit": vis["mean_large_visit"],
        "mean_small_visit": vis["mean_small_visit"],
        "tokens_per_answer": tokens / m if m else None,
        "committed_tokens": tokens,
        "flagged": n - m > 0,
        "first_error": (errors[0][:400] if errors else None),
    }


def _timing(rec: dict, runs: list[dict]) -> None:
    """A point's timing columns from its timed runs: medians, the throughput spread, the CPU
    time and the machine load, the cache state each run found, and whether repeats wrote other
    tokens than the first."""
    tps = [r["throughput_tok_s"] for r in runs if r.get("throughput_tok_s") is not None]
    med = _median(tps)
    rec.update(
        repeats=len(runs),
        throughput_tok_s=med,
        throughput_runs=tps,
        throughput_min=min(tps) if tps else None,
        throughput_max=max(tps) if tps else None,
        throughput_spread=(max(tps) - min(tps)) / med if tps and med else None,
        wall_s=_median([r["wall_s"] for r in runs]),
        mean_latency_s=_median([r.get("mean_latency_s") for r in runs]),
        tok_per_cpu_s=_median([r.get("tok_per_cpu_s") for r in runs]),
        cpu_s=_median([r.get("cpu_s") for r in runs]),
        other_share=_median([r.get("other_share") for r in runs]),
        prompt_tokens=runs[0]["prompt_tokens"],
        prefix_hit_tokens=runs[0]["prefix_hit_tokens"],
        prompt_tokens_fed=runs[0]["prompt_tokens"] - runs[0]["prefix_hit_tokens"],
        prompt_fed_runs=[r["prompt_fed"] for r in runs],
        repeat_mismatches=sum(r.get("tokens_hash") != runs[0].get("tokens_hash") for r in runs[1:]),
    )


# -- across points ---------------------------------------------------------------------------
def _agreement(records: list[dict], answers: dict, kind: str) -> None:
    """Each record's ``agreement`` with the large-only point's answers (and ``agreement_n``, the
    questions both answered), token agreement with its outputs, and each answer's ``agrees``
    (None where either request failed), in place; None without a large-only point. A question
    where either side extracted no answer never agrees (two missing answers are not a match: the
    ``no_answer`` column counts them)."""
    large = next((r for r in records if r["kind"] == "large_only"), None)
    if large is None:
        return
    ref = answers[large["label"]]
    for rec in records:
        ans = answers[rec["label"]]
        pairs = []
        for a, b in zip(ans, ref):
            both = a.get("ok", True) and b.get("ok", True)
            a["agrees"] = answers_equal(a["pred"], b["pred"], kind) if both else None
            if both:
                pairs.append((a, b))
        rec["agreement_n"] = len(pairs)
        rec["agreement"] = sum(a["agrees"] for a, _ in pairs) / len(pairs) if pairs else None
        ta = token_agreement([a.get("token_ids") or [] for a, _ in pairs], [b.get("token_ids") or [] for _, b in pairs])
        rec["token_agreement_prefix"], rec["token_agreement"] = ta if ta else (None, None)


def _paired(records: list[dict], answers: dict) -> list[dict]:
    """Paired differences of every swept point with small-only, large-only and its matched
    references, on the questions both answered (bootstrap 95% intervals)."""
    by = {r["label"]: r for r in records}
    fixed = [r for r in records if r["kind"] in ("small_only", "large_only")]
    out = []
    for rec in records:
        if rec["kind"] != "sweep":
            continue
        mine = answers[rec["label"]]
        refs = fixed + [
            r
            for r in records
            if r["kind"] in MATCHED and rec["label"] in (r.get("matched_points") or [r.get("matched_to")])
        ]
        for other in refs:
            theirs = answers[other["label"]]
            both = [(a, b) for a, b in zip(mine, theirs) if a.get("ok", True) and b.get("ok", True)]
            acc = paired_bootstrap([float(a["correct"]) for a, _ in both], [float(b["correct"]) for _, b in both])
            agr = None
            if other["kind"] != "large_only":
                pa = [(a, b) for a, b in both if a.get("agrees") is not None and b.get("agrees") is not None]
                agr = paired_bootstrap([float(a["agrees"]) for a, _ in pa], [float(b["agrees"]) for _, b in pa])
            out.append(
                {
                    "point": rec["label"],
                    "vs": other["label"],
                    "vs_kind": other["kind"],
                    "n": len(both),
                    "acc_diff": acc and acc["diff"],
                    "acc_diff_ci": acc and [acc["ci_low"], acc["ci_high"]],
                    "agree_diff": agr and agr["diff"],
                    "agree_diff_ci": agr and [agr["ci_low"], agr["ci_high"]],
                    "failed": rec["failed"] + by[other["label"]]["failed"],
                }
            )
    return out


def _summaries(records: list[dict]) -> list[dict]:
    """RouteLLM's APGR and large fraction at 50% / 80% of the large-only gain, per policy and
    quality measure (accuracy; agreement with large-only), each only where the policy's points
    carry it (`stats.gain_summary`; ``why_na`` says why not)."""
    small = next((r for r in records if r["kind"] == "small_only"), None)
    large = next((r for r in records if r["kind"] == "large_only"), None)
    groups: dict[str, list[dict]] = {}
    for r in records:
        if r["kind"] == "sweep":
            groups.setdefault(r.get("policy_name") or r["policy"], []).append(r)
    out = []
    for name, recs in groups.items():
        for metric in ("accuracy", "agreement"):
            row = {"policy": name, "metric": metric, "points": len(recs), "failed": sum(r["failed"] for r in recs)}
            lo = small.get(metric) if small else None
            hi = large.get(metric) if large else None
            if lo is None or hi is None:
                why = "needs the small_only and large_only references" + (
                    " and answered requests" if small and large else ""
                )
                row.update(
                    gain=None,
                    apgr=None,
                    large_fraction_50=None,
                    large_fraction_80=None,
                    why=why,
                    why_na=dict.fromkeys(("apgr", "large_fraction_50", "large_fraction_80"), why),
                )
            else:
                row.update(gain_summary([(r["large_fraction"], r.get(metric)) for r in recs if r["answered"]], lo, hi))
            out.append(row)
    return out


def _reference_points(run: _Runner, swept_labels: list[str], refs: set) -> tuple[list[_Point], list[dict]]:
    found, skipped = matched_references([run.records[label] for label in swept_labels], refs)
    pts = []
    for ref in found:
        stands = [label for label in swept_labels if _stands_for(ref, run.records[label])]
        pts.append(
            _Point(ref.label, ref.kind, ref.policy, ref.param, ref.value, ref.matched_to, None, ref.target, stands)
        )
    return pts, skipped


def _stands_for(ref, rec: dict) -> bool:
    f = rec.get("large_fraction")
    if f is None or round(float(f), 3) != ref.target["large_fraction"]:
        return False
    if ref.kind != "random_span":
        return True
    from .references import matched_references as _m

    again, _ = _m([rec], {"random_span"})
    return any(r.label == ref.label for r in again)


# -- the sweep -------------------------------------------------------------------------------
def evaluate_policy(
    router_or_models,
    policy_factory,
    values: Iterable[float] | None = None,
    *,
    dataset: str | Benchmark = "gsm8k",
    limit: int | None = 64,
    seed: int | None = 0,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    sampling_seed: int | None = 0,
    concurrency: int | None = 16,
    references: bool | Iterable[str] = True,
    out_dir=None,
    param: str | None = None,
    tokenizer=None,
    router_kwargs: dict | None = None,
    progress: bool = True,
    exclude_head_questions: bool = True,
    shard=None,
    repeats: int = DEFAULT_REPEATS,
    cache: str = "clear",
    target_large_share=None,
    calibration=CALIBRATION_QUESTIONS,
) -> EvalResult:
    """Sweep one policy over ``values`` on a benchmark; quality next to hop rate and throughput
    (`evaluate_policies` with one policy; the module docstring says what is measured and how).

    Args:
        router_or_models: a `Router` (used as is, left open), a dict name -> model (smallest
            first; give ``tokenizer``) or ``"default"``/None for `Router.default()`; a Router
            built here is closed at the end.
        policy_factory: value -> `Policy` (a callable), a Policy class (called with the value,
            as ``param=value`` when ``param`` is given), a `Policy` instance (one point as it
            is: no ``values`` or ``param``), or a built-in name: ``"rstitch"`` (tau),
            ``"random"`` (p), ``"random_query"`` (p), ``"r2r_entropy"`` (threshold), and with
            their packaged heads ``"r2r"`` (tau), ``"citer"`` (tau), ``"co_llm"`` (eta),
            ``"query"`` (threshold).
        values: the swept parameter values, one operating point each. None (default): what
            ``tokenrouter eval`` runs (`default_values`): 0.02, 0.05, 0.1, 0.2, 0.4 for the
            training-free built-ins, one point at the calibrated threshold of a learned head.
        dataset: a benchmark name or JSONL path (see `load_benchmark`) or a loaded `Benchmark`.
        limit, seed: the subset (``seed`` None: the first ``limit`` questions).
        max_new_tokens, temperature, sampling_seed: sampling (default greedy).
        concurrency: requests in flight per point (None: all questions at once).
        references: True for all of ``large_only``, ``small_only``, ``random``,
            ``random_span``, ``random_query`` (the last three matched to the swept points), False
            for none, or an iterable of those names. ``agreement`` needs ``large_only``.
        out_dir: folder for resumable per-point files (``points/``) and the final
            ``results.csv``, ``results.json`` and ``plot.html``.
        param: the swept parameter's name (for labels and the class form of ``policy_factory``).
        tokenizer: the shared tokenizer when ``router_or_models`` is a dict of model objects.
        router_kwargs: `Router` keyword arguments when the Router is built here.
        progress: a tqdm progress bar over the timed runs (warnings are shown after it).
        exclude_head_questions: leave out the questions the swept policies' learned heads were
            trained, validated or calibrated on (module docstring).
        shard: run only a share of the points: ``"i/N"`` (1-based) or ``(i, N)`` (0-based);
            needs ``out_dir``; `merge_sweep` gives the whole sweep.
        repeats: timed runs per point (>= 1), interleaved; the throughput is their median.
        cache: ``"clear"`` (default): every timed run starts with empty prefix caches;
            ``"keep"``: as the previous run left them.
        target_large_share: a share (or a list of shares) of committed tokens the large model
            should write: instead of ``values``, each point's threshold is calibrated for it on
            held-out questions (`tokenrouter_sdk.eval.calibrate.calibrate_large_share`: a
            bisection between the smallest and largest of ``values`` and 0 and 1), then
            evaluated; its record has ``target_large_share`` and ``calibration`` (the threshold,
            the share it realised on the calibration questions, the runs) beside the
            ``large_fraction`` realised on the evaluated questions. One threshold argument per
            policy (``param``).
        calibration: the held-out questions: their number (default 32), drawn from the same
            benchmark in the same order after leaving out the evaluated ones and the learned
            heads' (the ids are recorded), or a `Benchmark` / a list of prompts.

    Returns:
        an `EvalResult` (records in run order: large_only, small_only, the swept values, then the
        matched references).

    Raises:
        ValueError: no values, unknown reference names or policy, bad dataset arguments, a bad
            ``shard``, ``repeats`` or ``cache``, or a shard without ``out_dir``.
        TypeError: an unusable ``router_or_models`` or ``policy_factory``.
    """
    entry = _entry(None, policy_factory, values, param)
    return _evaluate(
        router_or_models,
        [entry],
        dataset=dataset,
        limit=limit,
        seed=seed,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        sampling_seed=sampling_seed,
        concurrency=concurrency,
        references=references,
        out_dir=out_dir,
        tokenizer=tokenizer,
        router_kwargs=router_kwargs,
        progress=progress,
        exclude_head_questions=exclude_head_questions,
        shard=shard,
        repeats=repeats,
        cache=cache,
        target_large_share=target_large_share,
        calibration=calibration,
        who="evaluate_policy",
    )


def evaluate_policies(router_or_models, policies: Mapping[str, Any], **kwargs) -> EvalResult:
    """Several policies on one question set, with one set of references: one large-only and one
    small-only run, matched references for every swept point, and the paired statistics and
    RouteLLM summaries per policy. The questions left out are the union of every learned head's
    training, validation and calibration questions, so every policy is scored on the same ones.

    Args:
        router_or_models: as in `evaluate_policy`.
        policies: name -> a policy factory (a built-in name, a Policy class, a callable value ->
            Policy), ``(factory, values)``, ``(factory, values, param)`` or ``{"policy": factory,
            "values": [...], "param": "..."}``, or a `Policy` instance (one point as it is, e.g.
            ``LargeOnly()`` or a policy without arguments; labelled ``name``). Without values an
            entry runs `default_values` (a learned head: its calibrated point). Labels are
            ``name(param=value)``.
        **kwargs: every other argument of `evaluate_policy` (``dataset``, ``limit``, ``repeats``,
            ``references``, ``out_dir``, ...), the same defaults.

    Returns:
        an `EvalResult` (large_only, small_only, each policy's swept values in the order given,
        then the matched references).

    Raises:
        ValueError: no policies, or as `evaluate_policy`.
        TypeError: as `evaluate_policy`.
    """
    if not policies:
        raise ValueError("policies is empty: give name -> policy, e.g. {'rstitch': 'rstitch', 'r2r': 'r2r'}")
    unknown = set(kwargs) - set(_EVALUATE_KWARGS)
    if unknown:
        raise TypeError(
            f"evaluate_policies got unexpected arguments {sorted(unknown)}; it takes {', '.join(_EVALUATE_KWARGS)}"
        )
    entries = [_entry(str(name), spec) for name, spec in policies.items()]
    return _evaluate(router_or_models, entries, who="evaluate_policies", **kwargs)


_EVALUATE_KWARGS = (
    "dataset",
    "limit",
    "seed",
    "max_new_tokens",
    "temperature",
    "sampling_seed",
    "concurrency",
    "references",
    "out_dir",
    "tokenizer",
    "router_kwargs",
    "progress",
    "exclude_head_questions",
    "shard",
    "repeats",
    "cache",
    "target_large_share",
    "calibration",
)


def _label(entry: _Entry, pol, v) -> str:
    if entry.param is None:  # one point of a policy as it is (beside a reference of the same name: marked)
        name = entry.name or type(pol).__name__
        return f"{name} (policy)" if name in REFERENCES else name
    pname = entry.label_param or entry.param
    return f"{entry.name or type(pol).__name__}({pname}={v:g})"


def _evaluate(
    router_or_models,
    entries: list[_Entry],
    *,
    dataset="gsm8k",
    limit=64,
    seed=0,
    max_new_tokens=256,
    temperature=0.0,
    sampling_seed=0,
    concurrency=16,
    references=True,
    out_dir=None,
    tokenizer=None,
    router_kwargs=None,
    progress=True,
    exclude_head_questions=True,
    shard=None,
    repeats=DEFAULT_REPEATS,
    cache="clear",
    target_large_share=None,
    calibration=None,
    who="evaluate_policy",
) -> EvalResult:
    refs = set(REFERENCES if references is True else () if references is False else references)
    if refs - set(REFERENCES):
        raise ValueError(f"unknown references {sorted(refs - set(REFERENCES))}; choose from {list(REFERENCES)}")
    if not (isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1):
        raise ValueError(f"repeats must be an int >= 1 (timed runs per point), got {repeats!r}")
    if cache not in CACHE_MODES:
        raise ValueError(
            f"cache must be one of {list(CACHE_MODES)} ('clear': every timed run starts with empty "
            f"prefix caches), got {cache!r}"
        )
    targets = check_targets(target_large_share)
    for e in entries:  # each first policy's head decides the questions (the others are built as they run)
        e.first = e.factory(e.values[0])
    head_ids, per_head = excluded_ids([e.first for e in entries])
    drop = head_ids if exclude_head_questions else set()
    if isinstance(dataset, Benchmark):
        bench = _without(dataset, drop) if drop else dataset
    else:
        bench = load_benchmark(dataset, limit=limit, seed=seed, exclude=drop)
    deferred: list[tuple[type, str]] = []
    excluded = overlap = None
    if drop:
        info = bench.extra["excluded"]
        excluded = {
            "heads": per_head,
            "in_draw": info["in_draw"],
            "draw": info["draw"],
            "in_benchmark": info["n"],
            "ids": info["ids"],
            "rule": "questions the heads' records list as trained, validated or "
            "calibrated on are left out before the limit is taken",
        }
        if info["n"]:
            heads = " and ".join(f"{k}'s ({v} ids)" for k, v in per_head.items())
            warnings.warn(
                f"{who}: left out {info['in_draw']} of the {info['draw']} questions drawn from "
                f"{bench.name} ({info['n']} in the whole benchmark) that {heads} head was trained, "
                f"validated or calibrated on"
                + (
                    "; the next questions in the same order took their places"
                    if not isinstance(dataset, Benchmark)
                    else ""
                )
                + ". exclude_head_questions=False scores them anyway",
                UserWarning,
                stacklevel=3,
            )
    elif head_ids:
        overlap = sorted(set(bench.ids) & head_ids)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": sampling_seed}
    index, n_shards = _shard(shard, out_dir)
    from ..policies import LargeOnly, SmallOnly

    router, owned = _open_router(router_or_models, tokenizer, dict(router_kwargs or {}))
    bar = None
    try:
        common = {
            "router": describe_router(router),
            "dataset": bench.describe(),
            "sampling": sampling,
            "concurrency": concurrency,
        }
        calibrated = {}
        if targets:  # every point's threshold from its target, on held-out questions
            calibrated, extra_cal = calibrate_entries(
                router, entries, targets, bench, dataset, calibration, drop, seed, sampling, concurrency, who
            )
            common["calibration"] = extra_cal
        fixed = [k for k in ("large_only", "small_only") if k in refs]
        units = fixed + [("sweep", i, j) for i, e in enumerate(entries) for j in range(len(e.values))]
        mine = [u for k, u in enumerate(units) if k % n_shards == index]  # shard i runs the units u with u % n == i
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=len(mine) * repeats,
                unit="run",
                desc="timed runs" + (f" (shard {index + 1}/{n_shards})" if n_shards > 1 else ""),
            )
        run = _Runner(router, bench, common, sampling, concurrency, out_dir, bar, cache, deferred)
        t0 = time.perf_counter()
        if "large_only" in mine:
            run.first(_Point("large_only", "large_only", LargeOnly(), None, None))
        if "small_only" in mine:
            run.first(_Point("small_only", "small_only", SmallOnly(), None, None))
        swept, labels = [], set()
        for u in mine:
            if not isinstance(u, tuple):
                continue
            _, i, j = u
            e, v = entries[i], entries[i].values[j]
            pol = e.first if j == 0 else e.factory(v)
            seen = excluded_ids([pol])[0] & set(bench.ids) if j and exclude_head_questions else set()
            if seen:
                deferred.append(
                    (
                        UserWarning,
                        f"{who}: the policy for {e.param}={v:g} has a learned head of its "
                        f"own that saw {len(seen)} of the questions scored (the questions "
                        f"were chosen by the first value's head); sweep one head per policy",
                    )
                )
            if e.param == "value" and not e.explicit_param and v is not None:  # name it after the attribute holding v
                e.label_param = next(
                    (
                        k
                        for k, a in vars(pol).items()
                        if not k.startswith("_") and isinstance(a, (int, float)) and not isinstance(a, bool) and a == v
                    ),
                    "value",
                )
            label = _label(e, pol, v)
            if (i, j) in calibrated:
                label = f"{label[:-1]}, target={calibrated[(i, j)]['target_large_share']:g})"
            if label in labels:
                raise ValueError(
                    f"{who}: two operating points are both labelled {label!r}; give each policy its own "
                    f"name and each value once"
                )
            labels.add(label)
            run.first(_Point(label, "sweep", pol, e.label_param or e.param, v, None, e.name))
            if (i, j) in calibrated:
                run.records[label].update(calibrated[(i, j)])
                run._save(label)
            swept.append(label)
        ref_points, skipped = _reference_points(run, swept, refs)
        if bar is not None:
            bar.total = (len(run.order) + len(ref_points)) * repeats
            bar.refresh()
        for pt in ref_points:
            run.first(pt)
        for r in range(1, repeats):  # interleaved: every point once per repeat, alternating direction
            for label in run.order[::-1] if r % 2 else run.order:
                run.again(label, r)
        records = [run.records[label] for label in run.order]
        extra = {"excluded": excluded} if excluded else {}
        if overlap is not None:
            extra["head_overlap"] = {"n": len(overlap), "ids": overlap, "heads": per_head}
        machine = load_summary(run.session_runs) if run.session_runs else None
        if machine and run.sim:  # simulated time: the machine's load cannot change the throughputs
            machine["high"] = False
        config = dict(
            common,
            **extra,
            policies=run.policies,
            swept={"param": entries[0].label_param or entries[0].param, "values": entries[0].values},
            sweeps={
                e.name or type(e.first).__name__: {"param": e.label_param or e.param, "values": e.values}
                for e in entries
            },
            references=sorted(refs),
            skipped_references=skipped,
            timing=_timing_config(repeats, cache, run.sim),
            run_order=run.log,
            machine=machine,
            versions=library_versions(),
            elapsed_s=time.perf_counter() - t0,
            finished=time.strftime("%Y-%m-%d %H:%M:%S"),
        )
    finally:
        if bar is not None:
            bar.close()
        if owned:
            router.close()
    for category, text in dict.fromkeys(deferred):  # after the progress bar, once each
        warnings.warn(text, category, stacklevel=3)
    if machine and machine["high"] and not run.sim:
        warnings.warn(f"{who}: {_load_text(machine)}", UserWarning, stacklevel=3)
    if n_shards == 1:
        return _assemble(
            records, {label: run.answers[label] for label in run.order}, config, bench.kind, out_dir, run.large
        )
    sweep_id = config_hash(
        common, {"sweeps": config["sweeps"], "references": sorted(refs), "repeats": repeats, "cache": cache}, "shards"
    )
    manifest = {
        "shard": index,
        "shards": n_shards,
        "sweep": sweep_id,
        "kind": bench.kind,
        "config": config,
        "large": run.large,
        "swept": {_unit_key(u): lab for u, lab in zip([u for u in mine if isinstance(u, tuple)], swept)},
        "points": {label: p.relative_to(out_dir).as_posix() for label, p in run.files.items()},
    }
    folder = Path(out_dir) / SHARDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"shard-{index + 1}-of-{n_shards}.json").write_text(json.dumps(manifest, default=str), encoding="utf-8")
    _agreement(records, run.answers, bench.kind)
    _check_all(records, run.answers, run.large, warn=True)
    return EvalResult(records, dict(config, shard=[index + 1, n_shards]), run.answers)


def _unit_key(u) -> str:
    return f"{u[1]}:{u[2]}"


def _timing_config(repeats: int, cache: str, sim: bool) -> dict:
    return {
        "repeats": repeats,
        "order": "interleaved: every point once per repeat, the repeats alternating in direction",
        "cache": cache,
        "cache_rule": (
            "every model's prefix cache is cleared before each timed run, so every run starts from "
            "the state of a new Router"
            if cache == "clear"
            else "the prefix cache is kept between runs: later runs may reuse what earlier ones left"
        ),
        "warmup": f"one untimed run of {WARMUP_PROMPTS} prompts x {WARMUP_TOKENS} tokens on both models first",
        "throughput": "committed tokens of answered requests / seconds from first admission to last finish, "
        "median over the repeats",
        "clock": "simulated" if sim else "wall",
    }


def _load_text(machine: dict) -> str:
    share = machine["other_share_median"]
    return (
        f"other processes used {share:.0%} of the {machine['cpus']} CPUs in the median timed run (up to "
        f"{machine['other_share_max']:.0%}; load average up to {machine['load_1m_max']:.2f}): the throughputs were "
        f"measured under load; time again on a quiet machine before comparing them"
    )


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


def _without(bench: Benchmark, ids: set[str]) -> Benchmark:
    """A loaded benchmark less the questions in ``ids`` (nothing takes their places)."""
    keep = [k for k, i in enumerate(bench.ids) if i not in ids]
    hit = [i for i in bench.ids if i in ids]
    extra = dict(bench.extra, excluded={"n": len(hit), "in_draw": len(hit), "draw": len(bench), "ids": hit})
    if not keep:
        raise ValueError(
            f"every question of the given benchmark ({len(bench)}) was used to make the policy's head; "
            f"pass exclude_head_questions=False to score them anyway"
        )
    return Benchmark(
        bench.name, bench.kind, bench.rows.select(keep), bench.source, bench.template, bench.limit, bench.seed, extra
    )


def _check_all(records: list[dict], answers: dict, large: str, warn: bool) -> None:
    for rec in records:
        if rec["kind"] in MATCHED:
            text = check_reference(rec, answers[rec["label"]], large)
            if text and warn:
                warnings.warn(text, UserWarning, stacklevel=4)


def _assemble(records: list[dict], answers: dict, config: dict, kind: str, out_dir, large: str) -> EvalResult:
    """The result of a whole sweep from its points in run order: agreement with large-only, the
    matched references checked against their targets, the paired statistics and summaries;
    saved to ``out_dir``."""
    _agreement(records, answers, kind)
    _check_all(records, answers, large, warn=True)
    stats = {"paired": _paired(records, answers), "summaries": _summaries(records)}
    res = EvalResult(records, config, answers, stats)
    if out_dir is not None:
        res.save(out_dir)
    return res


def merge_sweep(out_dir) -> EvalResult:
    """Merge the shards of one sweep (each run by ``evaluate_policy(..., shard=...)`` or
    ``tokenrouter eval --shard i/N`` into ``out_dir``) into the result the unsharded sweep gives:
    the same records in the same order (timings and prefix-cache counts are each shard's own;
    ``config["elapsed_s"]`` is their sum), agreement with large-only, the references' target
    checks and the paired statistics computed over all points. Saves it to ``out_dir``.

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
        raise ValueError(
            f"{folder} holds shards of different sweeps (other models, data, sampling, values or "
            f"shard count); give each sweep its own --out folder"
        )
    missing = sorted(set(range(1, n + 1)) - {m["shard"] + 1 for m in manifests})
    if missing:
        raise FileNotFoundError(
            f"shard(s) {missing} of {n} have not finished in {out_dir} (run them with --shard i/{n})"
        )
    recs, answers, policies, runs = {}, {}, {}, []
    for m in manifests:
        policies.update(m["config"].get("policies", {}))
        for label, rel in m["points"].items():
            path = Path(out_dir) / rel
            if not path.is_file():
                raise FileNotFoundError(f"point {label!r} of shard {m['shard'] + 1} is missing: {path}")
            saved = json.loads(path.read_text(encoding="utf-8"))
            recs[label], answers[label] = saved["record"], saved["answers"]
            runs.extend(saved.get("runs") or [])
    first = manifests[0]["config"]
    refs = first["references"]
    swept_labels = {k: label for m in manifests for k, label in m["swept"].items()}
    swept = [swept_labels[k] for k in sorted(swept_labels, key=lambda k: tuple(int(x) for x in k.split(":")))]
    order = [k for k in ("large_only", "small_only") if k in refs] + swept
    found, skipped = matched_references([recs[label] for label in swept], set(refs))
    for ref in found:
        order.append(ref.label)
        rec = recs[ref.label]
        rec["matched_to"] = ref.matched_to
        rec["matched_points"] = [label for label in swept if _stands_for(ref, recs[label])]
    records = [recs[label] for label in order]
    config = {k: v for k, v in first.items() if k not in ("elapsed_s", "finished", "policies", "run_order")}
    config.update(
        policies={label: policies[label] for label in order if label in policies},
        elapsed_s=sum(m["config"]["elapsed_s"] for m in manifests),
        shards=n,
        skipped_references=skipped,
        run_order=[x for m in manifests for x in m["config"].get("run_order", [])],
        machine=load_summary(runs) if runs else None,
        finished=max(m["config"]["finished"] for m in manifests),
    )
    return _assemble(
        records,
        {label: answers[label] for label in order},
        config,
        manifests[0]["kind"],
        out_dir,
        manifests[0].get("large", "large"),
    )
