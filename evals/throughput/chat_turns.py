"""A multi-turn chat through the OpenAI-compatible server, with the prefix cache on and off.

Two servers on 127.0.0.1 (free ports), each a `Router.default()` of the packaged pair in this
process (sub-servers in processes), one with ``prefix_cache=False``. A conversation of
``--turns`` turns: each turn sends the whole history plus a new user message (a GSM8K question,
shipped with the package, cut to about ``--user-tokens`` tokens; every turn of every
conversation, the unmeasured warm-up included, has its own question, so no turn finds its new
message already cached) and streams the reply
(``--max-tokens`` tokens, ``ignore_eos``), so each turn adds about ``--user-tokens +
--max-tokens`` tokens to the prompt. The two servers take turns conversation by conversation
(``--repeats`` each, interleaved). Time to first token (TTFT) = request sent to the first
streamed text chunk. Prints per turn the median TTFT with and without the cache and the bar:
the last turn's TTFT within 1.5x of the first turn's with the cache.

Run:
    .venv/bin/python evals/throughput/chat_turns.py --out evals/results/throughput

Writes ``<out>/chat_turns_turns<T>_t<N>.json`` and ``.csv`` (per turn the median TTFT with and
without the cache, every conversation's times, the hit rates).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def main(argv=None) -> int:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="conversations per setting (interleaved)")
    p.add_argument("--user-tokens", type=int, default=24, help="tokens of each new user message (about)")
    p.add_argument("--max-tokens", type=int, default=40, help="reply tokens per turn")
    p.add_argument("--policy", default="rstitch", help="the servers' policy (registry spec)")
    args = p.parse_args(argv)

    import json

    import httpx

    from tokenrouter_sdk import Router
    from tokenrouter_sdk.benchmarks import load
    from tokenrouter_sdk.policies.registry import builtin_registry

    questions = load("gsm8k", (args.repeats + 1) * args.turns).questions  # bare questions, no template
    servers = {}
    for cache in (True, False):
        r = Router.default(builtin_registry().build(args.policy), prefix_cache=cache)
        servers[cache] = (r, r.serve(port=0))
    tok = servers[True][0].tokenizer

    def user_message(i: int) -> str:
        ids = tok(questions[i], add_special_tokens=False)["input_ids"][: args.user_tokens]
        return tok.decode(ids)

    def converse(url: str, client: httpx.Client, conv: int) -> list[float]:
        messages, ttft = [], []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": user_message(conv * args.turns + turn)})
            body = {
                "model": "tokenrouter",
                "messages": messages,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            t0, first, text = time.perf_counter(), None, []
            with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
                    if delta and first is None:
                        first = time.perf_counter() - t0
                    text.append(delta)
            ttft.append(first if first is not None else float("nan"))
            messages.append({"role": "assistant", "content": "".join(text)})
        return ttft

    runs = {True: [], False: []}
    try:
        with httpx.Client() as client:
            for c in (True, False):  # warm-up conversation per server (unmeasured)
                converse(servers[c][1], client, args.repeats)
            for rep in range(args.repeats):
                for c in (True, False) if rep % 2 == 0 else (False, True):
                    runs[c].append(converse(servers[c][1], client, rep))
        stats = {c: servers[c][0].kv_stats() for c in servers}
    finally:
        for r, _ in servers.values():
            r.close()

    rows = []
    for t in range(args.turns):
        on = statistics.median(run[t] for run in runs[True])
        off = statistics.median(run[t] for run in runs[False])
        rows.append({"turn": t + 1, "ttft_cache_s": on, "ttft_no_cache_s": off, "speedup": off / on})
    print(
        evalkit.table(
            rows,
            [
                ("turn", "turn", "d"),
                ("ttft_cache_s", "TTFT cache (s)", ".3f"),
                ("ttft_no_cache_s", "TTFT no cache (s)", ".3f"),
                ("speedup", "off/on", ".2f"),
            ],
        )
    )
    last_vs_first = rows[-1]["ttft_cache_s"] / rows[0]["ttft_cache_s"]
    off_ratio = rows[-1]["ttft_no_cache_s"] / rows[0]["ttft_no_cache_s"]
    hit = {m: round(s.hit_rate, 3) for m, s in stats[True].items()}
    print(
        f"turn {args.turns} / turn 1 TTFT with the cache: {last_vs_first:.2f}x (bar <= 1.5x: "
        f"{'met' if last_vs_first <= 1.5 else 'NOT met'}); without: {off_ratio:.2f}x; hit rate per model {hit}"
    )
    evalkit.Output(args, __file__, evalkit.cells_tag(turns=args.turns, t=args.max_tokens)).write(
        rows,
        last_vs_first_cache=last_vs_first,
        last_vs_first_no_cache=off_ratio,
        hit_rate=hit,
        runs={str(k): v for k, v in runs.items()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
