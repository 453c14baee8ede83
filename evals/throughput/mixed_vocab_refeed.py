"""Handoffs between models that do not share a tokenizer, on the real mixed pairs: how many
tokens a hop feeds the receiving model, against what re-prefilling the whole context at every hop
would feed, and the one-unit speed and large-model share (docs/mixed-vocabularies.md).

Pairs: ``smollm2`` (SmolLM2-135M-Instruct -> Qwen2.5-Coder-1.5B-Instruct) and ``gemma3``
(Gemma-3-270M -> Qwen2.5-Coder-1.5B-Instruct), each routed by ``RStitch(tau)`` on the first
``--num`` GSM8K test questions in the GSM8K template (`tokenrouter_sdk.benchmarks.load_prompts`;
each model renders them with its own chat template, Gemma-3-270M has none), greedy, at most
``--max-new-tokens`` tokens of the large model's vocabulary each, ``--concurrency`` at a time. The
large model runs in ``--dtype`` (default: the pair's, `tokenrouter_sdk.pairs.pair_dtype`), the
small ones in their checkpoints' float32.

Per pair and threshold, from the run's `Retokenized` events (one per hop: ``refed``, the tokens the
receiver had in KV and fed again because their encoding changed; ``fed``, all it fed on
receiving; ``context``, its prompt + output tokens, which a receiver that re-prefilled the whole
context would feed):
- ``refed`` mean / max per hop;
- ``fed`` mean / max per hop against ``full`` (``context``) mean / max, over every hop and over the
  hops where the receiver already held the request (``ret_*``: its first receipt is its prefill
  under either scheme), and the ratio of their sums;
- committed tokens/s, characters/s and large-model tokens/s, large share in characters and in
  large-model tokens, hops per large-model token (`tokenrouter_sdk.metrics.Metrics`), and how
  many answers hold a U+FFFD replacement character (0 expected).

Run:
    .venv/bin/python evals/throughput/mixed_vocab_refeed.py --num 8 --max-new-tokens 128 --tau 0.1 0.3

Writes ``<out>/mixed_vocab_refeed_<pairs>_n<num>_t<tokens>.{json,csv}``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402

SMALL = ("smollm2", "gemma3")


def hop_stats(trace) -> dict:
    """Per-hop feeding numbers of one run's events (`Retokenized` only), as the docstring says."""
    from tokenrouter_sdk.engine.messages import Retokenized

    seen, every, back = set(), [], []
    for e in trace:
        if isinstance(e, Retokenized):
            every.append(e)
            if (e.rid, e.model) in seen:
                back.append(e)
            seen.add((e.rid, e.model))

    def agg(evs, pre):
        if not evs:
            return {f"{pre}hops": 0}
        return {
            f"{pre}hops": len(evs),
            f"{pre}fed_mean": statistics.fmean(e.fed for e in evs),
            f"{pre}fed_max": max(e.fed for e in evs),
            f"{pre}full_mean": statistics.fmean(e.context for e in evs),
            f"{pre}full_max": max(e.context for e in evs),
            f"{pre}fed_over_full": sum(e.fed for e in evs) / max(1, sum(e.context for e in evs)),
        }

    row = {
        "refed_mean": statistics.fmean(e.refed for e in every) if every else 0.0,
        "refed_max": max((e.refed for e in every), default=0),
    }
    row.update(agg(every, ""))
    row.update(agg(back, "ret_"))
    return row


def main() -> None:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument(
        "--pairs",
        nargs="+",
        choices=SMALL,
        default=list(SMALL),
        help="small models routed with Qwen2.5-Coder-1.5B-Instruct (default: both)",
    )
    p.add_argument("--num", type=int, default=8, help="GSM8K test questions (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="large-model tokens per answer (default 128)")
    p.add_argument("--tau", type=float, nargs="+", default=[0.1, 0.3], help="RStitch thresholds (default 0.1 0.3)")
    p.add_argument("--concurrency", type=int, default=4, help="requests at a time (default 4)")
    p.add_argument(
        "--dtype",
        default=None,
        help="the large model's dtype (default: the pair's, bfloat16 on a CPU with native bfloat16, else float32)",
    )
    args = p.parse_args()

    from tokenrouter_sdk import Router, SamplingParams
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.models import gemma3_270m_folder, smollm2_folder
    from tokenrouter_sdk.pairs import QWEN_CODER_15B, gguf_folder, pair_dtype
    from tokenrouter_sdk.policies import RStitch

    prompts = load_prompts("gsm8k", args.num)
    large = {"source": str(gguf_folder(QWEN_CODER_15B)), "dtype": str(pair_dtype(args.dtype)).replace("torch.", "")}
    folders = {"smollm2": smollm2_folder, "gemma3": gemma3_270m_folder}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for pair in args.pairs:
        spec = {"small": {"source": str(folders[pair]()), "dtype": "float32"}, "large": large}
        with Router(spec, RStitch(tau=args.tau[0])) as r:
            r.generate(prompts[:1], sampling=SamplingParams(max_new_tokens=4))  # warm-up: kernels, first steps
            for tau in args.tau:
                outs = r.generate(prompts, sampling=params, concurrency=args.concurrency, policy=RStitch(tau=tau))
                m = r.metrics(r.last_run)
                row = {
                    "pair": f"{pair}+qwen1.5b",
                    "tau": tau,
                    "large_dtype": large["dtype"],
                    "failed": sum(not o.ok for o in outs),
                    "fffd": sum("\ufffd" in o.text for o in outs),
                    "committed_tok": m.committed_tokens,
                    "large_tokens": m.large_tokens,
                    "chars": m.committed_chars,
                    "wall_s": m.wall_s,
                    "tok_s": m.throughput_tok_s,
                    "chars_s": m.throughput_chars_s,
                    "large_tok_s": m.throughput_large_tok_s,
                    "large_share_chars": m.large_fraction_chars,
                    "large_share_large_tok": m.large_fraction_large_tok,
                    "hop_rate_large_tok": m.hop_rate_large_tok,
                }
                row.update(hop_stats(r.last_run.trace))
                rows.append(row)
                print(f"{pair} tau={tau}: {row}", flush=True)
    out = evalkit.Output(args, __file__, evalkit.cells_tag("-".join(args.pairs), n=args.num, t=args.max_new_tokens))
    print(
        evalkit.table(
            rows,
            [
                ("pair", "pair", "s"),
                ("tau", "tau", ".2f"),
                ("hops", "hops", "d"),
                ("refed_mean", "refed/hop", ".2f"),
                ("refed_max", "max", "d"),
                ("fed_mean", "fed/hop", ".1f"),
                ("fed_max", "max", "d"),
                ("full_mean", "full/hop", ".1f"),
                ("full_max", "max", "d"),
                ("ret_fed_mean", "ret fed", ".1f"),
                ("ret_full_mean", "ret full", ".1f"),
                ("ret_fed_over_full", "ret fed/full", ".3f"),
                ("tok_s", "tok/s", ".2f"),
                ("chars_s", "chars/s", ".1f"),
                ("large_tok_s", "Ltok/s", ".2f"),
                ("large_share_chars", "L chars", ".3f"),
                ("large_share_large_tok", "L tok", ".3f"),
                ("hop_rate_large_tok", "hops/Ltok", ".3f"),
                ("fffd", "U+FFFD", "d"),
            ],
        )
    )
    out.write(rows, prompts=prompts)


if __name__ == "__main__":
    main()
