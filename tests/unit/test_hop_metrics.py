"""`hops` against `writer_changes`: a handoff after which the target commits nothing is a hop but
changes no writer; both, and their rates, are counted per request and per run."""

from tokenrouter_sdk import Handoff, Policy, Router, SamplingParams


class BounceOnce(Policy):
    """At output position 2 the small model hands off (discarding its token) and the large model
    hands straight back (discarding its own): two hops, no large token, no writer change. At
    position 4 it hands off and the large model writes one token: two hops, two writer changes."""

    def route(self, step):
        small, large = step.models
        bounced = step.state.setdefault("bounced", False)
        if step.position == 2 and step.model == small and not bounced:
            return large
        if step.position == 2 and step.model == large:
            step.state["bounced"] = True
            return small
        if step.position == 4 and step.model == small:
            return large
        return small if step.model == large and step.position > 4 else step.model

    def send(self, req, target):
        return Handoff(keep_sampled=False)


def test_hops_count_handoffs_without_a_commit_and_writer_changes_do_not(pair, tok):
    with Router(pair, BounceOnce(), tokenizer=tok) as r:
        out = r.generate([[5, 6, 7]], sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
        m = r.metrics()
    assert out.error is None
    assert out.token_models == ["small"] * 4 + ["large"] + ["small"] * 3
    assert out.hops == 4 and out.writer_changes == 2
    assert (m.hops, m.writer_changes) == (4, 2)
    assert m.hop_rate == 4 / 8 and m.writer_change_rate == 2 / 8
