"""What a policy's per-step data costs: per-step time and message size with and without `Needs`.

Three policies make the same routing decisions (RandomRouting's draws, so the workloads are equal):
``lean`` declares ``Needs()`` and reads nothing but the token; ``signals`` declares ``Needs()``
too and reads the step's entropy, max probability and top-5 (computed when read, no declaration);
``rich`` declares ``Needs(entropy=True, logits=True, hidden=True, topk=K)`` and reads entropy,
log-probabilities, top-K and the hidden state of every request at every step, as a learned router
does. They run alternately on one Router (the packaged pair, sub-servers in processes), so the
machine's drift hits all. Per model it reports the median step time, the median time of a step outside the model
forward (batch building, sampling, the policy, events) and committed tokens/s. Message size: the
encoded bytes (`engine.codec`) of a `HandoffMsg` (what travels per hop between sub-server
processes) with an empty policy state, with a generator in the state (what a seeded policy used
to ship) and with a full next-token distribution in the state (Co-LLM's composed decoding), of a
`StepDone` of 8 requests and of a one-token `Committed` (one per request per step).

Run:
    .venv/bin/python evals/throughput/needs_cost.py --concurrency 8 --tokens 64 --rounds 2

Writes ``<out>/needs_cost_<cells>.json`` and ``.csv`` (one row per policy, round and model).
"""

import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # evals/: evalkit
import evalkit  # noqa: E402


def message_sizes(vocab: int) -> dict:
    """Bytes on the wire of the per-hop and per-step messages, as the process transport encodes
    them (`tokenrouter_sdk.engine.transports.codec.encode`)."""
    import random

    import torch

    from tokenrouter_sdk.engine import messages
    from tokenrouter_sdk.engine.transports import codec

    def handoff(state):
        request_state = messages.RequestState({"small": 140, "large": 140}, 12, 3, 0, 1, state, 1, "small")
        return len(codec.encode(messages.HandoffMsg(7, "small", [101, 102], request_state, False, None)))

    rng = random.Random("42:7")
    rng.random()
    return {
        "handoff_empty_state": handoff({}),
        "handoff_generator_state": handoff({"rng": rng}),
        "handoff_distribution_state": handoff({"p": torch.softmax(torch.randn(vocab), -1)}),
        "step_done_batch8": len(
            codec.encode(
                messages.StepDone(
                    model="small",
                    t_start=1.0,
                    t_end=1.1,
                    forward_s=0.09,
                    batch_size=8,
                    tokens_fed=8,
                    fed={i: 1 for i in range(8)},
                    preempted=0,
                    round=None,
                    kv_used_blocks=100,
                    queued=3,
                    kv_pending_blocks=20,
                )
            )
        ),
        "committed_one_token": len(codec.encode(messages.Committed(7, "small", [101], 1.05))),
    }


def main() -> None:
    p = evalkit.parser(__file__, __doc__)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="lean/rich alternations (default 2)")
    p.add_argument("--p", type=float, default=0.1, help="RandomRouting probability (default 0.1)")
    p.add_argument("--topk", type=int, default=100, help="K the rich policy declares and reads (default 100)")
    args = p.parse_args()

    from tokenrouter_sdk import Needs, Router
    from tokenrouter_sdk.benchmarks import load_prompts
    from tokenrouter_sdk.engine.messages import StepDone
    from tokenrouter_sdk.policies import RandomRouting

    class Lean(RandomRouting):
        needs = Needs()

    class Rich(RandomRouting):
        needs = Needs(entropy=True, logits=True, hidden=True, topk=args.topk)

        def route_batch(self, batch):
            batch.entropy, batch.logprobs, batch.topk(args.topk), batch.hidden.norm(dim=-1)
            return super().route_batch(batch)

    class Signals(RandomRouting):
        needs = Needs()

        def route_batch(self, batch):
            batch.entropy, batch.max_prob, batch.topk(5)
            return super().route_batch(batch)

    prompts = load_prompts("gsm8k", 2 * args.concurrency)
    rows = []
    with Router.default() as router:
        vocab = router.engine.vocab_limit
        router.generate(prompts[:2], max_new_tokens=8, ignore_eos=True)  # warm-up
        for rnd in range(args.rounds):
            for name, pol in (("lean", Lean(args.p)), ("signals", Signals(args.p)), ("rich", Rich(args.p))):
                outs = router.generate(
                    prompts, policy=pol, max_new_tokens=args.tokens, ignore_eos=True, concurrency=args.concurrency
                )
                m = outs.metrics()
                steps = [e for e in outs.trace if isinstance(e, StepDone)]
                for model in router.models:
                    ss = [e for e in steps if e.model == model]
                    rows.append(
                        {
                            "policy": name,
                            "round": rnd,
                            "model": model,
                            "steps": len(ss),
                            "step_ms": 1e3 * st.median(e.t_end - e.t_start for e in ss),
                            "outside_forward_ms": 1e3 * st.median(e.t_end - e.t_start - e.forward_s for e in ss),
                            "tok_s": m.throughput_tok_s,
                            "hop_rate": m.hop_rate,
                            "large_fraction": m.large_fraction,
                        }
                    )
    print(
        evalkit.table(
            rows,
            [
                ("policy", "policy", "s"),
                ("round", "round", "d"),
                ("model", "model", "s"),
                ("steps", "steps", "d"),
                ("step_ms", "step ms", ".1f"),
                ("outside_forward_ms", "outside fwd ms", ".2f"),
                ("tok_s", "tok/s", ".1f"),
                ("large_fraction", "large", ".2f"),
            ],
        )
    )
    summary = {}
    for model in sorted({r["model"] for r in rows}):
        med = {
            name: st.median(r["outside_forward_ms"] for r in rows if r["model"] == model and r["policy"] == name)
            for name in ("lean", "signals", "rich")
        }
        step = {
            name: st.median(r["step_ms"] for r in rows if r["model"] == model and r["policy"] == name)
            for name in ("lean", "signals", "rich")
        }
        summary[model] = {
            "outside_forward_ms_lean": med["lean"],
            "outside_forward_ms_signals": med["signals"],
            "outside_forward_ms_rich": med["rich"],
            "saved_ms": med["rich"] - med["lean"],
            "step_ms_lean": step["lean"],
            "step_ms_signals": step["signals"],
            "step_ms_rich": step["rich"],
        }
        print(
            f"{model}: outside the forward, lean {med['lean']:.2f} ms, signals {med['signals']:.2f} ms, rich "
            f"{med['rich']:.2f} ms per step; whole step {step['lean']:.1f} / {step['signals']:.1f} / "
            f"{step['rich']:.1f} ms"
        )
    sizes = message_sizes(vocab)
    print("bytes per message: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))
    evalkit.Output(args, __file__, evalkit.cells_tag(c=args.concurrency, t=args.tokens)).write(
        rows, summary=summary, message_bytes=sizes
    )


if __name__ == "__main__":
    main()
