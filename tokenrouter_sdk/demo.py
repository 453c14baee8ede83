"""What routing buys, side by side: the same prompts with the large model alone, the small model
alone and a routing policy, on one `Router`, as one comparison table (`tokenrouter demo`).

Each run is one call (`Router.submit`): throughput is its committed tokens / its wall time
(`tokenrouter_sdk.metrics`); the final answers are checked against the benchmark's references
(`tokenrouter_sdk.eval.is_correct`) where the prompts have them, and compared with the large-only
run's (`tokenrouter_sdk.eval.answers_equal`: a missing answer agrees with nothing). `step_accounting` splits each
model's step time into pure
decode steps and steps that also fed a prefill or an extend (a request's first visit, or its
return after the peer wrote tokens), which is where a routed run loses time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .engine import messages
from .eval.answers import MATH, answers_equal, extract_answer, is_correct
from .metrics import Metrics
from .policies import LargeOnly, SmallOnly
from .policy import Policy


@dataclass
class DemoRun:
    """One run of the comparison.

    Attributes:
        name: ``"large-only"``, ``"small-only"`` or ``"routed"``.
        policy: the policy's repr.
        metrics: the call's `Metrics` (throughput_tok_s, large_fraction, hop_rate, ...).
        outputs: the `RequestOutput`s, in prompt order.
        answers: the final answer extracted from each output (None: none found).
        agree: per prompt, whether the answer agrees with the large-only run's (a missing
            answer on either side does not).
        correct: per prompt, whether the answer equals the benchmark's reference (empty when
            the prompts have none).
        steps: `step_accounting` of the call, per model.
        cpu_s: CPU seconds each model's sub-server process used during the run (None where
            it cannot be read: sub-servers in threads, or no ``/proc``).
    """

    name: str
    policy: str
    metrics: Metrics
    outputs: list
    answers: list
    agree: list = field(default_factory=list)
    correct: list = field(default_factory=list)
    steps: dict = field(default_factory=dict)
    cpu_s: dict | None = None

    @property
    def agreement(self) -> float:
        """Share of prompts whose answer agrees with the large-only run's, in [0, 1]."""
        return sum(self.agree) / len(self.agree) if self.agree else 0.0

    @property
    def accuracy(self) -> float | None:
        """Share of prompts answered as the reference says, in [0, 1]; None without references."""
        return sum(self.correct) / len(self.correct) if self.correct else None


def process_cpu_s(router) -> dict[str, float] | None:
    """CPU seconds (user + system) used so far by each model's sub-server process, from
    ``/proc/<pid>/stat``; None when the sub-servers run in threads or ``/proc`` is missing. On a
    shared machine a run's wall time depends on the CPU share it got; its CPU seconds do not."""
    pids = router.pids()
    if pids is None:
        return None
    out = {}
    try:
        tick = os.sysconf("SC_CLK_TCK")
        for model, pid in pids.items():
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[model] = (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return out


def step_accounting(events: list, models: list[str]) -> dict[str, dict]:
    """Where each model's step time went, from a call's `StepDone` events.

    Returns:
        per model: ``steps``; ``forward_s`` (seconds inside forwards); ``step_s`` (seconds from
        each step's start to its end: the forward plus scheduling, sampling and policy calls);
        ``decode_steps`` and ``decode_s`` (steps that fed one token per request);
        ``mixed_steps`` and ``mixed_s`` (steps that also fed a prefill or an extend),
        ``mixed_fed`` (tokens those steps fed beyond one per request); ``tokens_fed``;
        ``mean_batch`` (requests per step); ``batch_hist`` (requests per step -> steps).
    """
    out = {
        m: dict(
            steps=0,
            forward_s=0.0,
            step_s=0.0,
            decode_steps=0,
            decode_s=0.0,
            mixed_steps=0,
            mixed_s=0.0,
            mixed_fed=0,
            tokens_fed=0,
            mean_batch=0.0,
            batch_hist={},
        )
        for m in models
    }
    for ev in events:
        if not isinstance(ev, messages.StepDone) or ev.model not in out or not ev.batch_size:
            continue
        a = out[ev.model]
        a["steps"] += 1
        a["forward_s"] += ev.forward_s
        a["step_s"] += max(0.0, ev.t_end - ev.t_start)
        a["batch_hist"][ev.batch_size] = a["batch_hist"].get(ev.batch_size, 0) + 1
        a["tokens_fed"] += ev.tokens_fed
        a["mean_batch"] += ev.batch_size
        if ev.tokens_fed > ev.batch_size:
            a["mixed_steps"] += 1
            a["mixed_s"] += ev.forward_s
            a["mixed_fed"] += ev.tokens_fed - ev.batch_size
        else:
            a["decode_steps"] += 1
            a["decode_s"] += ev.forward_s
    for a in out.values():
        a["mean_batch"] = a["mean_batch"] / a["steps"] if a["steps"] else 0.0
        a["batch_hist"] = dict(sorted(a["batch_hist"].items()))
    return out


def run_comparison(
    router,
    prompts: list,
    policy: Policy,
    *,
    kind: str = MATH,
    baselines: bool = True,
    references: list | None = None,
    on_run=None,
    **sampling,
) -> list[DemoRun]:
    """Run ``prompts`` with `LargeOnly`, `SmallOnly` (``baselines``) and ``policy`` on ``router``.

    Args:
        router: a `Router` with at least two models (the last is "large").
        prompts: the prompts (strings, chat messages or token ids).
        policy: the routing policy.
        kind: answer kind for the agreement and accuracy checks (``"math"`` or ``"choice"``).
        references: the reference answer of each prompt (GSM8K's final numbers), for the
            accuracy column; None: no accuracy.
        baselines: False runs ``policy`` only (no agreement column then).
        on_run: called with each `DemoRun` as it finishes (e.g. to print progress; its
            ``agree`` is filled once every run is done).
        **sampling: `SamplingParams` fields (max_new_tokens, temperature, seed, concurrency, ...).

    Returns:
        the runs in the order large-only, small-only, routed (the routed one last).
    """
    plan = ([("large-only", LargeOnly()), ("small-only", SmallOnly())] if baselines else []) + [("routed", policy)]
    runs: list[DemoRun] = []
    for name, pol in plan:
        cpu0 = process_cpu_s(router)
        call = router.submit(prompts, policy=pol, **sampling)
        call.wait()
        cpu1 = process_cpu_s(router)
        outs = call.outputs
        run = DemoRun(
            name,
            repr(pol),
            call.metrics(),
            outs,
            [extract_answer(o.text, kind) if o.ok else None for o in outs],
            correct=[]
            if references is None
            else [o.ok and is_correct(o.text, str(ref), kind) for o, ref in zip(outs, references)],
            steps=step_accounting(list(call.events), list(router.models)),
            cpu_s=None if cpu0 is None or cpu1 is None else {m: cpu1[m] - cpu0[m] for m in cpu1},
        )
        runs.append(run)
        if on_run is not None:
            on_run(run)
    if baselines:
        ref = runs[0].answers
        for run in runs:
            run.agree = [
                a is not None and b is not None and answers_equal(a, b, kind) for a, b in zip(run.answers, ref)
            ]
    return runs


COLUMNS = (
    "run",
    "correct",
    "tok/s",
    "vs large",
    "large share",
    "hop rate",
    "agree w/ large",
    "tokens",
    "wall s",
    "tok/cpu-s",
)


def format_comparison(runs: list[DemoRun]) -> str:
    """The comparison table: per run, how many answers match the references (``-`` without
    references), committed tokens/s, its ratio to the large-only run's, the share of tokens the
    large model wrote, hops per committed token, how many final answers agree with the
    large-only run's, committed tokens, wall seconds, and committed tokens per CPU second of the
    sub-server processes (``-`` where unknown)."""
    base = next((r.metrics.throughput_tok_s for r in runs if r.name == "large-only"), None)
    rows = [COLUMNS]
    for r in runs:
        m = r.metrics
        ratio = f"{m.throughput_tok_s / base:.2f}x" if base else "-"
        agree = f"{sum(r.agree)}/{len(r.agree)}" if r.agree else "-"
        cpu = sum(r.cpu_s.values()) if r.cpu_s else 0.0
        correct = f"{sum(r.correct)}/{len(r.correct)}" if r.correct else "-"
        rows.append(
            (
                r.name,
                correct,
                f"{m.throughput_tok_s:.1f}",
                ratio,
                f"{100 * m.large_fraction:.0f}%",
                f"{m.hop_rate:.3f}",
                agree,
                str(m.committed_tokens),
                f"{m.wall_s:.1f}",
                f"{m.committed_tokens / cpu:.1f}" if cpu > 0 else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_accounting(runs: list[DemoRun]) -> str:
    """One line per run and model: steps, mean batch, CPU seconds of its process (where known),
    forward seconds (wall) split into pure decode steps and steps that also fed a prefill or an
    extend (with the tokens they fed beyond one per request)."""
    lines = []
    for r in runs:
        for model, a in r.steps.items():
            if not a["steps"]:
                continue
            cpu = f" cpu={r.cpu_s[model]:.1f}s" if r.cpu_s and model in r.cpu_s else ""
            lines.append(
                f"{r.name:<11} [{model}] steps={a['steps']} mean_batch={a['mean_batch']:.1f}{cpu} "
                f"forward={a['forward_s']:.1f}s: decode {a['decode_steps']} steps {a['decode_s']:.1f}s, "
                f"prefill/extend {a['mixed_steps']} steps {a['mixed_s']:.1f}s "
                f"({a['mixed_fed']} tokens)"
            )
    return "\n".join(lines)
