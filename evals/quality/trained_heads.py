"""Trained R2R and CITER heads on the packaged CPU pair (`Router.default()`): how well they pick
the tokens that need the large model, against random routing at the same large fraction.

1. Train both heads on GSM8K train questions (the default of `tokenrouter_sdk.train`; ``--train`` questions,
   responses / gold / rollouts of at most ``--max-new-tokens`` tokens); the validation questions
   (a quarter of them, by question) give the held-out labels: recall and precision of the
   router at its recall-0.95 threshold, and AUC.
2. On the 128 held-out questions (gsm8k-test-0000..0127, never trained on): large-only greedy
   answers; then each head at the threshold that routes about 0.2 of the small model's own greedy
   steps on ``--calibrate`` training prompts (teacher-forced validation rows score differently
   from free-running generation), and `RandomRouting` at the large fraction the head realised.
   Reported against the large-only answer: final-answer agreement (`eval.answers`, math-verify),
   token agreement (share of the large-only answer's positions holding the same token) and
   common-prefix share; plus gold accuracy, realised large fraction and hop rate.

Run:
    .venv/bin/python evals/quality/trained_heads.py --train 48 --max-new-tokens 96

Writes ``<out>/trained_heads_<cells>.json`` (everything) and ``.csv`` (one row per routing run), and
the heads themselves under ``<out>/trained_heads_<cells>/`` (``r2r_head.*``, ``citer_head.*``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def agreement(outs, ref_outs, examples) -> dict:
    """Agreement of routed answers with the large-only answers (and gold accuracy)."""
    from tokenrouter_sdk.eval.answers import answers_agree, extract_answer, is_correct

    fa, tok, pre, acc, large, total, hops = [], [], [], [], 0, 0, 0
    for o, r, ex in zip(outs, ref_outs, examples):
        a, b = o.token_ids, r.token_ids
        n = max(1, len(b))
        tok.append(sum(x == y for x, y in zip(a, b)) / n)
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        pre.append(k / n)
        fa.append(answers_agree(extract_answer(o.text), extract_answer(r.text)))
        acc.append(is_correct(o.text, ex.answer))
        large += o.token_models.count("large")
        total += len(o.token_ids)
        hops += o.hops
    m = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    return {
        "final_answer_agreement": m(fa),
        "token_agreement": m(tok),
        "prefix_share": m(pre),
        "gold_accuracy": m(acc),
        "large_fraction": large / max(1, total),
        "hop_rate": hops / max(1, total),
        "tokens": total,
    }


def calibrate(router, res, prompts, rate: float, max_new_tokens: int) -> float:
    """Threshold routing about ``rate`` of the small model's own greedy steps on training prompts
    (the teacher-forced validation rows score differently from free-running generation)."""
    import torch

    from tokenrouter_sdk.policies import RandomRouting
    from tokenrouter_sdk.policy import StepBatch
    from tokenrouter_sdk.request import RequestView
    from tokenrouter_sdk.train.common import forward_features, threshold_for_rate

    small = router.models["small"]
    outs = router.generate(prompts, policy=RandomRouting(p=0.0), max_new_tokens=max_new_tokens)
    pol, scores = res.policy(), []
    for p, o in zip(prompts, outs):
        ids = router.encode(p)
        h, lg = forward_features(small, ids + o.token_ids)
        P, n = len(ids), len(o.token_ids)
        views = [
            RequestView(
                rid=i, prompt_ids=[1], output_ids=[], owner="small", state={}, hops=0, models=("small", "large")
            )
            for i in range(n)
        ]
        b = StepBatch(
            "small", ("small", "large"), torch.tensor(o.token_ids), lg[P - 1 : P - 1 + n], h[P - 1 : P - 1 + n], views
        )
        with torch.no_grad():
            scores.append(pol.prob(b) if res.kind == "r2r" else pol.confidence(b))
    return threshold_for_rate(torch.cat(scores), rate, above=res.kind == "r2r")


def main(argv=None) -> int:
    ap = evalkit.parser(__file__, __doc__)
    ap.add_argument("--train", type=int, default=48, help="training questions (after the 128 held-out ones)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--branches", type=int, default=6, help="R2R verified positions per response")
    ap.add_argument("--rollouts", type=int, default=2, help="CITER rollouts per example")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--small-layers", type=int, default=None, help="plain truncation instead of Router.default()'s small model"
    )
    ap.add_argument(
        "--calibrate", type=int, default=12, help="training prompts whose small-only answers set the ~0.2 threshold"
    )
    args = ap.parse_args(argv)

    import torch

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.policies import LargeOnly, RandomRouting
    from tokenrouter_sdk.train import load_examples, train_citer, train_r2r
    from tokenrouter_sdk.train.data import HELDOUT

    torch.set_num_threads(args.threads)
    output = evalkit.Output(args, __file__, evalkit.cells_tag(n=args.train, t=args.max_new_tokens))
    out, t0, report = output.path(""), time.perf_counter(), {}
    M, C = args.max_new_tokens, args.concurrency
    heldout = load_examples("gsm8k", limit=HELDOUT, exclude_heldout=False)  # GSM8K test: never trained on
    assert [e.id for e in heldout] == [f"gsm8k-test-{i:04d}" for i in range(HELDOUT)]
    with Router.default(processes=False, small_layers=args.small_layers) as router:
        r2r = train_r2r(
            router,
            limit=args.train,
            out=out,
            max_new_tokens=M,
            branch_tokens=24,
            max_branches=args.branches,
            concurrency=C,
        )
        print(f"[{time.perf_counter() - t0:.0f}s] R2R trained: {json.dumps(r2r.metrics, default=str)}", flush=True)
        citer = train_citer(
            router,
            limit=args.train,
            out=out,
            rollout_tokens=M,
            max_rollouts=args.rollouts,
            max_gold_tokens=M,
            concurrency=C,
        )
        print(f"[{time.perf_counter() - t0:.0f}s] CITER trained: {json.dumps(citer.metrics, default=str)}", flush=True)
        report["models"] = r2r.meta["models"]
        report["heads"] = {
            "r2r": {"path": str(r2r.head_path), "tau_recall95": r2r.threshold, **r2r.metrics},
            "citer": {"path": str(citer.head_path), "tau_recall95": citer.threshold, **citer.metrics},
        }
        prompts = [e.prompt for e in heldout]
        gen = lambda pol: router.generate(prompts, policy=pol, max_new_tokens=M, concurrency=C)  # noqa: E731
        ref = gen(LargeOnly())
        report["large_only"] = agreement(ref, ref, heldout)
        small = gen(RandomRouting(p=0.0))
        report["small_only"] = agreement(small, ref, heldout)
        print(f"[{time.perf_counter() - t0:.0f}s] large-only / small-only done", flush=True)
        calib = [e.prompt for e in load_examples(limit=args.train)[: args.calibrate]]
        for name, res, key in (("r2r", r2r, "tau"), ("citer", citer, "tau")):
            tau = calibrate(router, res, calib, 0.2, M)
            routed = agreement(gen(res.policy(**{key: tau})), ref, heldout)
            rnd = agreement(gen(RandomRouting(p=routed["large_fraction"], seed=0)), ref, heldout)
            report[name] = {"tau": tau, "routed": routed, "random_same_fraction": rnd}
            print(f"[{time.perf_counter() - t0:.0f}s] {name}: routed {routed}\n   random {rnd}", flush=True)
    report["seconds"] = time.perf_counter() - t0
    print(f"\n{'run':<22}{'large frac':>11}{'final ans agr':>14}{'token agr':>10}{'prefix':>8}{'gold acc':>9}")
    rows = [("large-only", report["large_only"]), ("small-only", report["small_only"])]
    for name in ("r2r", "citer"):
        rows += [
            (f"{name} (tau={report[name]['tau']:.3g})", report[name]["routed"]),
            (f"random @ {name} frac", report[name]["random_same_fraction"]),
        ]
    for n, r in rows:
        print(
            f"{n:<22}{r['large_fraction']:>11.3f}{r['final_answer_agreement']:>14.3f}{r['token_agreement']:>10.3f}"
            f"{r['prefix_share']:>8.3f}{r['gold_accuracy']:>9.3f}"
        )
    for name in ("r2r", "citer"):
        v = report["heads"][name]["val"]
        print(
            f"{name} held-out labels (val questions) at recall-0.95 tau: recall {v['recall']:.3f} "
            f"precision {v['precision']:.3f} AUC {v['auc']:.3f} routed share {v['positive_rate']:.3f}"
        )
    print(f"total {report['seconds']:.0f} s")
    output.write([{"run": n, **r} for n, r in rows], **report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
