"""Every built-in routing policy on the packaged CPU pair at a matched large fraction, with
`RandomRouting` at the same large fraction beside each; the bar of the packaged heads.

Prompts: the first ``--num`` held-out GSM8K test questions (``gsm8k-test-0000`` ..; never trained
on), or with ``--offset K`` the first ``--num`` from question K on that no packaged head was
trained, validated or calibrated on (their records' ids, `tokenrouter_sdk.eval.head_data`; the
output says how many were left out, ``--include-trained`` keeps them), in the GSM8K template of
`tokenrouter_sdk.benchmarks`, chat-templated, greedy, at most ``--max-new-tokens`` tokens each,
``--concurrency`` requests at a time, one `Router.default()`. Every row is measured on the same
questions (their ids are in the output's ``meta``).
Rows:
- ``LargeOnly`` (the reference answers) and ``SmallOnly``;
- the learned policies with no arguments (``CITER()``, ``R2R()``, ``CoLLM()``, ``QueryRouter()``):
  their packaged heads at their default thresholds (the token-level ones target 0.7 large
  fraction, the query head 0.25 of the prompts);
- the training-free ones (``RStitch``, ``R2REntropy``, ``R2RAleatoric``, ``GlimpRouter``,
  ``TokenEnsemble``) at the threshold that realises about ``--target`` large fraction on
  ``--calibrate`` GSM8K test questions past the held-out ones (``gsm8k-test-0128`` .., as the
  recorded tables were made; never scored); one-token deferral rules by score
  quantiles as in `tokenrouter_sdk.train.package.calibrate_defer`, the others by bisection, in a
  threaded Router); `TokenEnsemble` gets weights (1 - target, target);
- beside each, ``RandomRouting(p)`` with p = the realised large fraction (rerun with p corrected
  while the two differ by more than ``--match``); for ``QueryRouter`` also
  ``RandomQueryRouting(p)`` with p = its share of prompts answered by the large model (the
  query-level baseline: a query router keeps whole large-model answers, which token-level
  random routing at the same token fraction cannot).
Per row: final-answer agreement with LargeOnly (`tokenrouter_sdk.eval.answers_agree` on
`extract_answer`, with its Wilson 95% interval), the paired difference with the random row
(bootstrap 95% interval over questions, 10,000 resamples; exact McNemar p on the discordant
questions), token agreement and common-prefix share with the large-only answer, gold accuracy,
realised large fraction, hop rate, committed tokens/s and wall time. Resumable: every run is kept
in ``--cache`` and reused when its configuration matches.

Run:
    .venv/bin/python evals/quality/policy_table.py --num 128 --max-new-tokens 96 --out evals/results/quality

Writes ``<out>/policy_table_n<num>_t<tokens>[_at].{csv,md,json}`` (``_at`` when ``--at`` rows are
asked for).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

from tokenrouter_sdk import Router  # noqa: E402
from tokenrouter_sdk.eval.answers import answers_agree, extract_answer, is_correct
from tokenrouter_sdk.eval.config import library_versions, wilson_interval
from tokenrouter_sdk.eval.head_data import record_ids
from tokenrouter_sdk.policies import (
    CITER,
    R2R,
    CoLLM,
    GlimpRouter,
    LargeOnly,
    QueryRouter,
    R2RAleatoric,
    R2REntropy,
    RandomQueryRouting,
    RandomRouting,
    RStitch,
    SmallOnly,
    TokenEnsemble,
)
from tokenrouter_sdk.policies.heads import packaged_head_path
from tokenrouter_sdk.policies.r2r import aleatoric_uncertainty
from tokenrouter_sdk.train.data import HELDOUT, load_examples
from tokenrouter_sdk.train.package import calibrate_defer

LEARNED = {
    "CITER": (CITER, "citer"),
    "R2R": (R2R, "r2r"),
    "CoLLM": (CoLLM, "co_llm"),
    "QueryRouter": (QueryRouter, "query"),
}


# -- calibration of the training-free policies -------------------------------------------------------
def bisect(
    router,
    factory,
    lo: float,
    hi: float,
    prompts,
    target: float,
    *,
    decreasing: bool,
    log: bool,
    rounds: int,
    max_new_tokens: int,
    tol: float = 0.02,
) -> tuple[float, list[dict]]:
    """Bisection of a threshold in [lo, hi] (geometric when ``log``) for a realised large fraction
    of about ``target``; the fraction falls with the threshold when ``decreasing``."""
    hist = []
    for _ in range(rounds):
        v = math.sqrt(lo * hi) if log else (lo + hi) / 2
        router.generate(prompts, policy=factory(v), max_new_tokens=max_new_tokens, temperature=0.0, concurrency=16)
        f = router.metrics().large_fraction
        hist.append({"threshold": v, "large_fraction": f})
        if abs(f - target) <= tol:
            break
        if (f > target) == decreasing:
            lo = v
        else:
            hi = v
    best = min(hist, key=lambda h: abs(h["large_fraction"] - target))
    return best["threshold"], hist


def calibrate_free(prompts, target: float, max_new_tokens: int, rounds: int) -> dict:
    """name -> {"value", "rounds"} for the training-free policies (threaded Router)."""
    out = {}
    with Router.default(processes=False) as router:
        router.generate(prompts[:2], max_new_tokens=4)
        v, h = calibrate_defer(
            router,
            lambda t: R2REntropy(threshold=t),
            lambda p, b: b.entropy,
            prompts,
            target,
            start=0.45,
            above=True,
            max_new_tokens=max_new_tokens,
            rounds=rounds,
        )
        out["R2REntropy"] = {"value": v, "rounds": h}
        print(f"calibrated R2REntropy threshold {v:.4g}: {h}", flush=True)
        v, h = calibrate_defer(
            router,
            lambda t: R2RAleatoric(threshold=t),
            lambda p, b: torch.nan_to_num(aleatoric_uncertainty(b.topk(p.k)[0], p.k), nan=1e9),
            prompts,
            target,
            start=2.275,
            above=True,
            max_new_tokens=max_new_tokens,
            rounds=rounds,
        )
        out["R2RAleatoric"] = {"value": v, "rounds": h}
        print(f"calibrated R2RAleatoric threshold {v:.4g}: {h}", flush=True)
        v, h = bisect(
            router,
            lambda t: RStitch(tau=t),
            0.005,
            0.5,
            prompts,
            target,
            decreasing=True,
            log=True,
            rounds=rounds + 2,
            max_new_tokens=max_new_tokens,
        )
        out["RStitch"] = {"value": v, "rounds": h}
        print(f"calibrated RStitch tau {v:.4g}: {h}", flush=True)
        v, h = bisect(
            router,
            lambda t: GlimpRouter(theta=t),
            0.05,
            8.0,
            prompts,
            target,
            decreasing=True,
            log=True,
            rounds=rounds + 2,
            max_new_tokens=max_new_tokens,
        )
        out["GlimpRouter"] = {"value": v, "rounds": h}
        print(f"calibrated GlimpRouter theta {v:.4g}: {h}", flush=True)
    return out


# -- runs ------------------------------------------------------------------------------------------
def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else "missing"


def run(router, name: str, policy, prompts, args, cache: Path, key_extra=None) -> dict:
    """Generate with ``policy`` (or load the cached run) -> record with per-question outputs."""
    key = hashlib.sha256(
        json.dumps(
            [name, repr(policy), len(prompts), args.max_new_tokens, args.concurrency, key_extra],
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()[:16]
    f = cache / f"{name.replace(' ', '_').replace('/', '_')}-{key}.json"
    if f.exists():
        return json.loads(f.read_text())
    t = time.perf_counter()
    outs = router.generate(
        prompts, policy=policy, max_new_tokens=args.max_new_tokens, temperature=0.0, concurrency=args.concurrency
    )
    m = router.metrics()
    bad = [o for o in outs if not o.ok]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} requests failed: {bad[0].error}")
    large = list(router.models)[-1]
    rec = {
        "name": name,
        "policy": repr(policy),
        "key": key,
        "wall_s": time.perf_counter() - t,
        "large_fraction": m.large_fraction,
        "hop_rate": m.hop_rate,
        "committed_tokens": m.committed_tokens,
        "discarded_tokens": m.discarded_tokens,
        "tok_s": m.throughput_tok_s,
        "loadavg": os.getloadavg()[0],
        "texts": [o.text for o in outs],
        "token_ids": [list(o.token_ids) for o in outs],
        "large_only_request": [bool(o.token_ids) and set(o.token_models) == {large} for o in outs],
    }
    f.write_text(json.dumps(rec))
    print(
        f"  {name:<34} large {m.large_fraction:.3f}  hops/tok {m.hop_rate:.3f}  {m.throughput_tok_s:6.1f} tok/s  "
        f"{rec['wall_s']:.0f} s",
        flush=True,
    )
    return rec


def score(rec: dict, ref: dict, examples) -> dict:
    """Per-question agreement flags and the row's quality numbers against the large-only run."""
    agree, tok, pre, gold = [], [], [], []
    for text, ids, rtext, rids, ex in zip(rec["texts"], rec["token_ids"], ref["texts"], ref["token_ids"], examples):
        agree.append(int(answers_agree(extract_answer(text), extract_answer(rtext))))
        n = max(1, len(rids))
        tok.append(sum(a == b for a, b in zip(ids, rids)) / n)
        k = next((i for i, (a, b) in enumerate(zip(ids, rids)) if a != b), min(len(ids), len(rids)))
        pre.append(k / n)
        gold.append(int(is_correct(text, ex.answer)))
    n = len(agree)
    lo, hi = wilson_interval(sum(agree), n)
    return {
        "agree": agree,
        "agreement": sum(agree) / n,
        "agree_lo": lo,
        "agree_hi": hi,
        "token_agreement": float(np.mean(tok)),
        "prefix_share": float(np.mean(pre)),
        "gold_accuracy": sum(gold) / n,
        "n": n,
    }


def paired(a: list[int], b: list[int], resamples: int = 10000, seed: int = 0) -> dict:
    """Difference of mean(a) - mean(b) over the same questions: bootstrap 95% interval and the
    exact two-sided McNemar p (binomial test on the discordant questions)."""
    x, y = np.array(a, float), np.array(b, float)
    idx = np.random.default_rng(seed).integers(0, len(x), (resamples, len(x)))
    d = x[idx].mean(1) - y[idx].mean(1)
    n01, n10 = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    k, n = min(n01, n10), n01 + n10
    p = 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {
        "diff": float(x.mean() - y.mean()),
        "diff_lo": float(lo),
        "diff_hi": float(hi),
        "mcnemar_p": p,
        "only_policy": n01,
        "only_random": n10,
        "significant": bool(lo > 0 or hi < 0),
    }


def matched_random(router, name, f: float, prompts, args, cache) -> dict:
    """RandomRouting at large fraction ``f`` (p corrected until within ``args.match``)."""
    p, tried = f, []
    for _ in range(3):
        rec = run(router, f"RandomRouting@{name}", RandomRouting(p=round(p, 4), seed=0), prompts, args, cache)
        tried.append(rec | {"p": round(p, 4)})
        if abs(rec["large_fraction"] - f) <= args.match:
            break
        p = min(1.0, max(0.0, p + f - rec["large_fraction"]))
    return min(tried, key=lambda r: abs(r["large_fraction"] - f))


def trained_ids() -> set[str]:
    """Every question id a packaged head was trained, validated or calibrated on (their JSON records)."""
    ids = set()
    for _, kind in LEARNED.values():
        ids |= record_ids(json.loads(packaged_head_path(kind).with_suffix(".json").read_text()))
    return ids


def pick_questions(offset: int, num: int, include_trained: bool) -> tuple[list, list[str]]:
    """The first ``num`` GSM8K test questions from ``offset`` on, less those a packaged head saw
    (unless ``include_trained``) -> (examples, ids left out on the way)."""
    seen = set() if include_trained else trained_ids()
    out, skipped = [], []
    for e in load_examples("gsm8k", exclude_heldout=False)[offset:]:
        if len(out) == num:
            break
        if e.id in seen:
            skipped.append(e.id)
        else:
            out.append(e)
    if len(out) < num:
        raise SystemExit(f"only {len(out)} GSM8K test questions from {offset} on are left (asked for {num})")
    return out, skipped


# -- report ----------------------------------------------------------------------------------------
COLS = [
    "policy",
    "setting",
    "large_fraction",
    "hop_rate",
    "tok_s",
    "agreement",
    "agree_lo",
    "agree_hi",
    "random",
    "random_large_fraction",
    "random_hop_rate",
    "random_tok_s",
    "random_agreement",
    "random_agree_lo",
    "random_agree_hi",
    "diff",
    "diff_lo",
    "diff_hi",
    "mcnemar_p",
    "significant",
    "token_agreement",
    "random_token_agreement",
    "prefix_share",
    "gold_accuracy",
    "n",
    "wall_s",
    "query_share",
    "rq_agreement",
    "rq_agree_lo",
    "rq_agree_hi",
    "rq_diff",
    "rq_diff_lo",
    "rq_diff_hi",
    "rq_mcnemar_p",
    "note",
]


def write(rows: list[dict], meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, COLS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    ci = lambda r, p="": f"{r[p + 'agreement']:.3f} [{r[p + 'agree_lo']:.2f}, {r[p + 'agree_hi']:.2f}]"  # noqa: E731
    ids = meta["ids"] if isinstance(meta["ids"], str) else f"{meta['ids'][0]}..{meta['ids'][-1][-4:]}"
    left = meta.get("excluded", {}).get("n", 0)
    ids += f", leaving out {left} a packaged head was trained, validated or calibrated on" if left else ""
    lines = [
        f"Packaged CPU pair, {meta['n']} held-out GSM8K test questions ({ids}), greedy, "
        f"{meta['max_new_tokens']} tokens, concurrency {meta['concurrency']}; agreement = final answer "
        f"equal to LargeOnly's (Wilson 95%); diff = policy - RandomRouting at the same large fraction "
        f"(paired bootstrap 95%; McNemar p).",
        "",
        "| policy | setting | large frac | hops/token | tok/s | agreement | RandomRouting (same frac) | "
        "large frac | tok/s | agreement | diff [95%] | McNemar p | token agr. (policy / random) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "random" not in r:
            lines.append(
                f"| {r['policy']} | {r['setting']} | {r['large_fraction']:.3f} | {r['hop_rate']:.3f} | "
                f"{r['tok_s']:.1f} | {ci(r)} | | | | | | | {r['token_agreement']:.3f} |"
            )
            continue
        sig = "" if r["significant"] else " (n.s.)"
        lines.append(
            f"| {r['policy']} | {r['setting']} | {r['large_fraction']:.3f} | {r['hop_rate']:.3f} | "
            f"{r['tok_s']:.1f} | {ci(r)} | {r['random']} | {r['random_large_fraction']:.3f} | "
            f"{r['random_tok_s']:.1f} | {ci(r, 'random_')} | {r['diff']:+.3f} [{r['diff_lo']:+.2f}, "
            f"{r['diff_hi']:+.2f}]{sig} | {r['mcnemar_p']:.2g} | {r['token_agreement']:.3f} / "
            f"{r['random_token_agreement']:.3f} |"
        )
    for r in rows:
        if "rq_agreement" in r:
            lines += [
                "",
                f"{r['policy']} against the query-level random baseline "
                f"RandomQueryRouting(p={r['query_share']:.3g}) (the same share of prompts answered by the large "
                f"model; token large fraction {r['rq_large_fraction']:.3f}): agreement {r['rq_agreement']:.3f} "
                f"[{r['rq_agree_lo']:.2f}, {r['rq_agree_hi']:.2f}], diff {r['rq_diff']:+.3f} "
                f"[{r['rq_diff_lo']:+.2f}, {r['rq_diff_hi']:+.2f}]{'' if r['rq_significant'] else ' (n.s.)'}, "
                f"McNemar p {r['rq_mcnemar_p']:.2g}.",
            ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def record_heldout(rows: list[dict], meta: dict, command: str) -> None:
    """Write each learned row's held-out numbers into its packaged head's JSON record (``heldout``)."""
    for r in rows:
        if r["policy"] not in LEARNED or "random" not in r:
            continue
        js = packaged_head_path(LEARNED[r["policy"]][1]).with_suffix(".json")
        rec = json.loads(js.read_text())
        held = {
            "n": r["n"],
            "ids": meta["ids"],
            "max_new_tokens": meta["max_new_tokens"],
            "greedy": True,
            "large_fraction": r["large_fraction"],
            "hop_rate": r["hop_rate"],
            "agreement": r["agreement"],
            "agreement_wilson95": [r["agree_lo"], r["agree_hi"]],
            "token_agreement": r["token_agreement"],
            "gold_accuracy": r["gold_accuracy"],
            "random": {
                "policy": r["random"],
                "large_fraction": r["random_large_fraction"],
                "agreement": r["random_agreement"],
                "agreement_wilson95": [r["random_agree_lo"], r["random_agree_hi"]],
            },
            "diff": r["diff"],
            "diff_bootstrap95": [r["diff_lo"], r["diff_hi"]],
            "mcnemar_p": r["mcnemar_p"],
            "significant": r["significant"],
            "command": command,
            "metric": "final answers (tokenrouter_sdk.eval answers_agree) equal to LargeOnly's on the same prompts",
        }
        if "rq_agreement" in r:
            held["query_share"] = r["query_share"]
            held["random_query"] = {
                "policy": f"RandomQueryRouting(p={r['query_share']:.3g})",
                "large_fraction": r["rq_large_fraction"],
                "agreement": r["rq_agreement"],
                "agreement_wilson95": [r["rq_agree_lo"], r["rq_agree_hi"]],
                "diff": r["rq_diff"],
                "diff_bootstrap95": [r["rq_diff_lo"], r["rq_diff_hi"]],
                "mcnemar_p": r["rq_mcnemar_p"],
                "significant": r["rq_significant"],
            }
        rec["heldout"] = held
        js.write_text(json.dumps(rec, indent=1))
        print(f"recorded held-out numbers in {js}")


def main() -> None:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--num", type=int, default=128, help=f"held-out questions (at most {HELDOUT})")
    ap.add_argument(
        "--offset",
        type=int,
        default=0,
        help="start at GSM8K test question OFFSET instead of the reserved held-out ones (0); "
        "questions a packaged head was trained, validated or calibrated on are left out "
        "(the output says how many)",
    )
    ap.add_argument(
        "--include-trained",
        action="store_true",
        help="keep the questions a packaged head was trained, validated or calibrated on",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--target", type=float, default=0.25, help="large fraction of the training-free rows")
    ap.add_argument("--match", type=float, default=0.02, help="largest |random - policy| large fraction")
    ap.add_argument("--calibrate", type=int, default=8, help="training questions for the training-free thresholds")
    ap.add_argument("--calibrate-rounds", type=int, default=4)
    ap.add_argument("--only", nargs="*", help="row names to run (default: all)")
    ap.add_argument(
        "--at",
        nargs="*",
        metavar="NAME=THRESHOLD",
        help="extra rows: a learned policy (CITER, R2R, CoLLM, QueryRouter) with its packaged head at "
        "this threshold, e.g. R2R=0.0435 (with RandomRouting beside it)",
    )
    ap.add_argument("--threads", action="store_true", help="sub-servers in threads (default: processes)")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads of this process (the threaded calibration Router; default 1: on a shared "
        "machine 2 threads per process ran 3-5x slower)",
    )
    ap.add_argument("--cache", default=".cache/policy_table")
    ap.add_argument(
        "--record",
        action="store_true",
        help="write the learned rows' numbers into the packaged heads' JSON records (heldout)",
    )
    args = ap.parse_args()
    out = Path(args.out) / (
        "policy_table_"
        + evalkit.cells_tag(o=args.offset or None, n=args.num, t=args.max_new_tokens)
        + ("_at" if args.at else "")
    )
    torch.set_num_threads(args.torch_threads)
    if args.offset == 0 and not 1 <= args.num <= HELDOUT:
        raise SystemExit(f"--num must be in 1..{HELDOUT} (the held-out questions)")
    examples, skipped = pick_questions(args.offset, args.num, args.include_trained)
    print(
        f"questions: {len(examples)} GSM8K test questions from gsm8k-test-{args.offset:04d} on; left out "
        f"{len(skipped)} a packaged head was trained, validated or calibrated on"
        + (" (--include-trained: none left out)" if args.include_trained else ""),
        flush=True,
    )
    prompts = [e.prompt for e in examples]
    cache = Path(args.cache) / (f"offset{args.offset}" if args.offset else "")
    cache.mkdir(parents=True, exist_ok=True)
    want = lambda n: not args.only or n in args.only  # noqa: E731
    t0 = time.perf_counter()
    calib_file = cache / f"calibration-{args.target}-{args.calibrate}-{args.max_new_tokens}.json"
    free = ("RStitch", "R2REntropy", "R2RAleatoric", "GlimpRouter")
    if any(want(n) for n in free):
        if calib_file.exists():
            cal = json.loads(calib_file.read_text())
        else:
            calib = [e.prompt for e in load_examples("gsm8k", limit=args.calibrate)]
            cal = calibrate_free(calib, args.target, args.max_new_tokens, args.calibrate_rounds)
            calib_file.write_text(json.dumps(cal, indent=1))
    ids = [e.id for e in examples]
    contiguous = ids == [f"gsm8k-test-{i:04d}" for i in range(int(ids[0][-4:]), int(ids[0][-4:]) + len(ids))]
    rows, meta = (
        [],
        {
            "n": args.num,
            "ids": f"{ids[0]}..{ids[-1][-4:]}" if contiguous else ids,
            "excluded": {
                "n": len(skipped),
                "ids": skipped,
                "rule": "GSM8K test questions a packaged head was trained, validated or "
                "calibrated on (their records) are left out"
                if not args.include_trained
                else "none left out (--include-trained)",
            },
            "max_new_tokens": args.max_new_tokens,
            "concurrency": args.concurrency,
            "target": args.target,
            "versions": library_versions(),
            "heads": {
                k: {"path": str(packaged_head_path(kind)), "sha256_16": sha(packaged_head_path(kind))}
                for k, (_, kind) in LEARNED.items()
            },
            "processes": not args.threads,
            "torch_threads": torch.get_num_threads(),
        },
    )
    with Router.default(processes=not args.threads) as router:
        router.generate(prompts[:2], max_new_tokens=4)
        ref = run(router, "LargeOnly", LargeOnly(), prompts, args, cache)
        base = lambda rec, policy, setting, note="": {  # noqa: E731
            "policy": policy,
            "setting": setting,
            "large_fraction": rec["large_fraction"],
            "hop_rate": rec["hop_rate"],
            "tok_s": rec["tok_s"],
            "wall_s": rec["wall_s"],
            "note": note,
            **score(rec, ref, examples),
        }
        rows.append(base(ref, "LargeOnly", "reference"))
        rows.append(base(run(router, "SmallOnly", SmallOnly(), prompts, args, cache), "SmallOnly", ""))
        todo = []
        for name, (cls, kind) in LEARNED.items():
            if want(name):
                pol = cls()
                thr = {"CITER": "tau", "R2R": "tau", "CoLLM": "eta", "QueryRouter": "threshold"}[name]
                todo.append(
                    (name, pol, f"packaged head, default {thr}={getattr(pol, thr):.4g}", sha(packaged_head_path(kind)))
                )
        for spec in args.at or []:  # extra operating points of the packaged heads
            name, _, value = spec.partition("=")
            cls, kind = LEARNED[name]
            thr = {"CITER": "tau", "R2R": "tau", "CoLLM": "eta", "QueryRouter": "threshold"}[name]
            todo.append(
                (
                    f"{name}({thr}={float(value):.4g})",
                    cls(**{thr: float(value)}),
                    f"packaged head, {thr}={float(value):.4g}",
                    sha(packaged_head_path(kind)),
                )
            )
        if any(want(n) for n in free):
            mk = {
                "RStitch": lambda v: (RStitch(tau=v), f"tau={v:.4g}"),
                "R2REntropy": lambda v: (R2REntropy(threshold=v), f"threshold={v:.4g}"),
                "R2RAleatoric": lambda v: (R2RAleatoric(threshold=v), f"threshold={v:.4g}"),
                "GlimpRouter": lambda v: (GlimpRouter(theta=v), f"theta={v:.4g}"),
            }
            for name in free:
                if want(name):
                    pol, setting = mk[name](cal[name]["value"])
                    todo.append((name, pol, setting + " (calibrated)", None))
        if want("TokenEnsemble"):
            todo.append(
                (
                    "TokenEnsemble",
                    TokenEnsemble(weights=[1 - args.target, args.target]),
                    f"weights=({1 - args.target:g}, {args.target:g})",
                    None,
                )
            )
        for name, pol, setting, extra in todo:
            rec = run(router, name, pol, prompts, args, cache, extra)
            row = base(rec, name, setting)
            rnd = matched_random(router, name, rec["large_fraction"], prompts, args, cache)
            rs = score(rnd, ref, examples)
            row |= {
                "random": f"RandomRouting(p={rnd['p']:.3g})",
                "random_large_fraction": rnd["large_fraction"],
                "random_hop_rate": rnd["hop_rate"],
                "random_tok_s": rnd["tok_s"],
                "random_agreement": rs["agreement"],
                "random_agree_lo": rs["agree_lo"],
                "random_agree_hi": rs["agree_hi"],
                "random_token_agreement": rs["token_agreement"],
                "random_agree": rs["agree"],
                **paired(row["agree"], rs["agree"]),
            }
            rows.append(row)
            if name == "QueryRouter":  # the query-level random baseline: same share of prompts on the large model
                share = sum(rec["large_only_request"]) / len(prompts)
                q = run(
                    router,
                    "RandomQueryRouting@QueryRouter",
                    RandomQueryRouting(p=round(share, 4), seed=0),
                    prompts,
                    args,
                    cache,
                )
                qs, pq = score(q, ref, examples), paired(row["agree"], score(q, ref, examples)["agree"])
                row |= {
                    "query_share": share,
                    "rq_large_fraction": q["large_fraction"],
                    "rq_agreement": qs["agreement"],
                    "rq_agree_lo": qs["agree_lo"],
                    "rq_agree_hi": qs["agree_hi"],
                    **{f"rq_{k}": v for k, v in pq.items()},
                }
                rows[-1] = row
            write(rows, meta | {"seconds": time.perf_counter() - t0}, out)
    meta["seconds"] = time.perf_counter() - t0
    write(rows, meta, out)
    if args.record:
        import shlex
        import sys

        record_heldout(rows, meta, shlex.join([".venv/bin/python", *sys.argv]))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
