"""Sub-servers in threads: the engine learns their KV and request counts through the transport
(`StatsQuery`), never by reading a sub-server's state from the caller's thread while that
sub-server steps (its request table is mutated by its own thread only)."""

import threading

import pytest

from tokenrouter_sdk import Router
from tokenrouter_sdk.models import tiny_tokenizer

from ..helpers import Alternate, ScriptedRunner, mixed_prompts, pools_free

TOKENS = list(range(65, 91))


class OneThreadDict(dict):
    """A dict that records every thread that reads or writes it (``threads``)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads: set[str] = set()

    def _seen(self):
        self.threads.add(threading.current_thread().name)


def _recording(name):
    method = getattr(dict, name)

    def wrapped(self, *a, **kw):
        self._seen()
        return method(self, *a, **kw)

    return wrapped


for _name in (
    "__getitem__",
    "__setitem__",
    "__delitem__",
    "__iter__",
    "__len__",
    "__contains__",
    "__bool__",
    "get",
    "pop",
    "items",
    "keys",
    "values",
    "setdefault",
    "popitem",
    "update",
    "clear",
):
    if hasattr(dict, _name):
        setattr(OneThreadDict, _name, _recording(_name))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_stats_and_idle_never_read_a_stepping_sub_server_from_the_callers_thread(mode):
    runners = {
        "small": ScriptedRunner(lambda p: TOKENS[p % 26], delay_s=0.002),
        "large": ScriptedRunner(lambda p: TOKENS[(p + 3) % 26], delay_s=0.002),
    }
    with Router(runners, tokenizer=tiny_tokenizer(), processes=False, mode=mode) as r:
        tables = {}
        for name, ss in r.engine.transport.subservers.items():
            ss.sched.seqs = tables[name] = OneThreadDict(ss.sched.seqs)
        outs, done = {}, threading.Event()

        def run():
            try:
                outs["v"] = r.generate(mixed_prompts(6), max_new_tokens=24, ignore_eos=True, policy=Alternate())
            finally:
                done.set()

        worker = threading.Thread(target=run, name="generate")
        worker.start()
        asked = 0
        while not done.is_set():
            stats = r.kv_stats()
            assert set(stats) == {"small", "large"} and all(s.alive for s in stats.values())
            r.engine.idle()
            asked += 1
        worker.join()
        assert asked > 0 and all(o.ok and len(o.token_ids) == 24 for o in outs["v"])
        assert r.engine.wait_idle(10)
        assert all(free == usable for free, usable in pools_free(r).values())
        for name, table in tables.items():
            assert table.threads, name  # the sub-server used the table ...
            assert len(table.threads) == 1 and threading.main_thread().name not in table.threads, (
                name,
                table.threads,
            )  # ... and only its own thread did
