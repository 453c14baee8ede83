"""A message that cannot reach a dead sub-server is answered by a dead letter (`dead_letter`: the
request's `Finished(failed)`). A hub can bounce one before the death itself is reported (the
peer's socket is gone before its process's end is seen); the request's KV on the live models must
still come back, and a request the live model is serving must stop there, not run on unseen."""

import time

from tokenrouter_sdk import Policy, Router
from tokenrouter_sdk.engine import messages
from tokenrouter_sdk.engine.runner import dead_letter

from ..helpers import mixed_prompts


class ToLargeAtThree(Policy):
    """Slowly: request 0 stays on the small model; any other goes to the large one at output
    position 3 and stays there (its prompt's KV kept pending on the small one)."""

    def route(self, step):
        time.sleep(0.05)
        if step.request.rid != 0 and step.position >= 3:
            return "large"
        return step.model


def test_a_dead_letter_before_the_death_is_known_frees_the_request_on_the_live_models(pair, tok):
    with Router(pair, ToLargeAtThree(), tokenizer=tok, processes=False) as r:
        keep, h = r.submit(mixed_prompts(2, seed=3), max_new_tokens=300, ignore_eos=True)
        deadline = time.monotonic() + 60
        while not h.output.hops or r.kv_stats()["small"].pending != 1:
            assert time.monotonic() < deadline and not h.done.is_set()
            time.sleep(0.01)
        assert r.dead == {}  # no death reported: the letter comes first, as a hub may bounce it
        handoff = messages.HandoffMsg(h.rid, "small", [], None, True, None)
        letter = dead_letter("large", handoff, "gone", time.perf_counter())
        assert letter is not None and letter.undelivered
        r.engine.handle_event(letter)
        assert h.done.is_set() and h.output.finish_reason == "failed" and "model 'large' is dead" in h.output.error
        deadline = time.monotonic() + 5  # the live models stop serving it and free its blocks
        while True:
            st = r.kv_stats()
            if st["small"].pending == 0 and st["large"].owned == 0:
                break
            assert time.monotonic() < deadline, {m: (s.owned, s.pending) for m, s in st.items()}
            time.sleep(0.05)
        assert not keep.done.is_set() and st["small"].owned == 1  # the other request is served on
        keep.abort("the test is done")
