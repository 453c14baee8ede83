"""Every built-in policy of `tokenrouter_sdk.policies` runs on `Router.default()` with its default
arguments: the learned ones (CITER, R2R, Co-LLM, QueryRouter) on their packaged heads."""

import pytest

from tokenrouter_sdk import Router, policies
from tokenrouter_sdk.policy import Policy

pytestmark = pytest.mark.integration

PROMPTS = ["What is 7 + 5?", "Janet has 3 apples and buys 4 more. How many apples does she have?"]
CLASSES = [getattr(policies, n) for n in policies.__all__
           if isinstance(getattr(policies, n), type) and issubclass(getattr(policies, n), Policy)]


@pytest.fixture(scope="module")
def router():
    with Router.default() as r:       # sub-servers in processes, as a user gets it
        yield r


def test_the_list_is_complete():
    assert {c.__name__ for c in CLASSES} == {
        "SingleModel", "SmallOnly", "LargeOnly", "RandomRouting", "RStitch", "CITER", "R2R", "R2REntropy",
        "R2RAleatoric", "CoLLM", "GlimpRouter", "TokenEnsemble", "QueryRouter", "RandomQueryRouting"}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_builtin_policy_runs_with_default_arguments(router, cls):
    pol = cls("large") if cls is policies.SingleModel else cls()   # SingleModel's one argument is its model
    learned = cls in (policies.CITER, policies.R2R, policies.CoLLM)
    n = 32 if learned else 12             # long enough for each packaged head to defer at least once
    outs = router.generate(PROMPTS, policy=pol, max_new_tokens=n)
    for o in outs:
        assert o.ok, o.error
        assert 1 <= len(o.token_ids) <= n and len(o.token_models) == len(o.token_ids)
        assert o.finish_reason in ("length", "eos", "stop")
    m = router.metrics()
    assert m.committed_tokens == sum(len(o.token_ids) for o in outs) and m.failed == 0
    if learned:
        assert 0 < m.large_fraction < 1          # the packaged head sends some tokens, not all, to the large model
    assert all(s.alive for s in router.kv_stats().values())
