"""The demo's comparison (tokenrouter_sdk.demo): three runs on one Router, the table and the
step accounting (tiny pair; the real demo runs in tests/integration/test_cli.py)."""

from tokenrouter_sdk import Router
from tokenrouter_sdk.demo import format_accounting, format_comparison, process_cpu_s, run_comparison, step_accounting
from tokenrouter_sdk.engine.messages import StepDone
from tokenrouter_sdk.policies import RandomRouting

from ..helpers import mixed_prompts


def test_step_accounting_splits_decode_from_prefill_and_extend():
    ev = [
        StepDone(model="small", t_start=0, t_end=1, forward_s=0.5, batch_size=2, tokens_fed=40, fed={0: 20, 1: 20}),
        StepDone(model="small", t_start=1, t_end=2, forward_s=0.1, batch_size=2, tokens_fed=2, fed={0: 1, 1: 1}),
        StepDone(model="large", t_start=2, t_end=3, forward_s=0.3, batch_size=1, tokens_fed=6, fed={0: 6}),
        StepDone(model="large", t_start=3, t_end=4, forward_s=0.0, batch_size=0, tokens_fed=0, fed={}),
        StepDone(model="other", t_start=0, t_end=1, forward_s=9.0, batch_size=1, tokens_fed=1, fed={0: 1}),
    ]
    a = step_accounting(ev, ["small", "large"])
    assert a["small"] == dict(
        steps=2,
        forward_s=0.6,
        step_s=2.0,
        decode_steps=1,
        decode_s=0.1,
        mixed_steps=1,
        mixed_s=0.5,
        mixed_fed=38,
        tokens_fed=42,
        mean_batch=2.0,
        batch_hist={2: 2},
    )
    assert (a["large"]["steps"], a["large"]["mixed_fed"], a["large"]["decode_steps"]) == (1, 5, 0)


def test_run_comparison_on_one_router(pair, tok):
    prompts = mixed_prompts(4, seed=2)
    seen = []
    with Router(pair, tokenizer=tok, prefill_peers=True) as r:
        runs = run_comparison(
            r,
            prompts,
            RandomRouting(p=0.5, seed=1),
            max_new_tokens=8,
            ignore_eos=True,
            on_run=lambda run: seen.append(run.name),
        )
        assert process_cpu_s(r) is None  # sub-servers in threads: no per-process CPU time
    assert seen == [run.name for run in runs] == ["large-only", "small-only", "routed"]
    large, small, routed = runs
    assert large.metrics.large_fraction == 1.0 and small.metrics.large_fraction == 0.0
    assert 0 < routed.metrics.large_fraction < 1 and routed.metrics.hops > 0
    assert all(run.metrics.committed_tokens == 32 and len(run.agree) == 4 for run in runs)
    assert large.agree == [a is not None for a in large.answers]  # a missing answer agrees with nothing
    assert large.accuracy is None and large.correct == []  # no references given
    assert large.steps["small"]["steps"] == 0 and large.steps["large"]["tokens_fed"] == sum(map(len, prompts)) + 28
    table = format_comparison(runs).splitlines()
    assert table[0].split()[:4] == ["run", "correct", "tok/s", "vs"] and [row.split()[0] for row in table[2:]] == [
        "large-only",
        "small-only",
        "routed",
    ]
    assert table[2].split()[1] == "-" and table[2].split()[3:5] == ["1.00x", "100%"] and table[2].split()[-1] == "-"
    acc = format_accounting(runs)
    assert "routed      [large]" in acc and "large-only  [small]" not in acc


class _Out:
    def __init__(self, text):
        self.text, self.ok = text, True


def test_the_accuracy_column_counts_answers_equal_to_the_references(monkeypatch):
    from tokenrouter_sdk import demo

    class Call:
        def __init__(self, texts):
            self.outputs, self.events = [_Out(t) for t in texts], []

        def wait(self):
            return self

        def metrics(self):
            return None

    texts = {
        "LargeOnly": ["so 18 dollars. The answer is 18", "The answer is 3", "no number here"],
        "SmallOnly": ["The answer is 16", "The answer is 3", "nothing"],
        "RandomRouting": ["#### 18", "I do not know", "The answer is 7"],
    }

    class Router:
        models = {"small": None, "large": None}

        def pids(self):
            return None

        def submit(self, prompts, policy, **kw):
            return Call(texts[type(policy).__name__])

    monkeypatch.setattr(demo, "step_accounting", lambda events, models: {})
    runs = demo.run_comparison(Router(), ["a", "b", "c"], RandomRouting(p=0.5), references=["18", "3", "7"])
    assert [r.correct for r in runs] == [[True, True, False], [False, True, False], [True, False, True]]
    assert [r.accuracy for r in runs] == [2 / 3, 1 / 3, 2 / 3]
    # agreement with large-only: a missing answer (large-only's third, routed's second) agrees with nothing
    assert [r.agree for r in runs] == [[True, True, False], [False, True, False], [True, False, False]]
