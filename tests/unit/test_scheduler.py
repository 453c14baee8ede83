"""The per-model `Scheduler` on its own: a `BlockAllocator` of 4-token blocks and hand-made `Seq`s, no model.

A step is played by hand: `schedule()` picks the batch and grows its block tables; the sub-server
would then feed each request ``tokens[kv_len:]`` and set ``kv_len = len(tokens)``
(`finish_step` below), and a decode appends one token."""

from __future__ import annotations

import pytest

from tokenrouter_sdk.engine.core.block_allocator import BlockAllocator
from tokenrouter_sdk.engine.core.scheduler import Scheduler, Seq
from tokenrouter_sdk.request import RequestConfig, SamplingParams

BLOCK = 4


def make_seq(rid: int, n_tokens: int) -> Seq:
    ids = [3 + (rid + i) % 200 for i in range(n_tokens)]
    return Seq(RequestConfig(rid, list(ids), SamplingParams(), policy_key=0), tokens=list(ids))


def make_scheduler(num_blocks: int, **kw) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks, BLOCK), **kw)


def finish_step(batch: list[Seq], new_token: bool = True) -> None:
    """What the sub-server does after the forward: the fed tokens are in the KV; a decode adds one."""
    for s in batch:
        s.kv_len = len(s.tokens)
        if new_token:
            s.tokens.append(7)


def test_fifo_order_and_block_tables_cover_the_tokens():
    sch = make_scheduler(16)
    seqs = [make_seq(rid, n) for rid, n in ((5, 3), (1, 5), (3, 9))]
    for s in seqs:
        sch.add_owned(s)
        assert s.status == "waiting"
    batch = sch.schedule()
    assert [s.rid for s in batch] == [5, 1, 3]  # arrival order, not rid order
    assert [len(s.table) for s in batch] == [1, 2, 3] and all(s.status == "running" for s in batch)
    assert sch.blocks.num_free == 16 - 6 and sch.unfit == [] and sch.preemptions == 0
    assert len({b for s in batch for b in s.table}) == 6  # no block shared between requests


def test_tables_grow_by_a_block_only_when_the_tokens_cross_a_boundary():
    sch = make_scheduler(8)
    s = make_seq(0, 3)
    sch.add_owned(s)
    tables = []
    for _ in range(6):  # 3 -> 8 tokens, then 9
        batch = sch.schedule()
        assert batch == [s]
        tables.append(list(s.table))
        finish_step(batch)
    assert [len(t) for t in tables] == [1, 1, 2, 2, 2, 2]
    assert all(t[: len(prev)] == prev for prev, t in zip(tables, tables[1:])), "blocks are kept, new ones appended"
    assert sch.schedule() == [s] and len(s.table) == 3  # 9 tokens: a third block
    assert sch.blocks.num_free == 8 - 3


def test_pending_requests_lose_their_kv_first_oldest_first():
    sch = make_scheduler(6)
    old, young, back = make_seq(0, 8), make_seq(1, 4), make_seq(2, 4)
    for s in (old, young, back):
        sch.add_owned(s)
    finish_step(sch.schedule(), new_token=False)  # 2 + 1 + 1 blocks
    for s in (old, young, back):
        sch.set_pending(s)
    assert (old.status, old.kv_len, len(old.table)) == ("pending", 8, 2)  # handed off: KV kept
    newcomer = make_seq(3, 12)  # 3 blocks; 2 free
    sch.add_owned(newcomer)
    sch.add_owned(back)  # handed back after the newcomer arrived: owned, with its KV, after it in FIFO
    batch = sch.schedule()
    assert [s.rid for s in batch] == [3, 2]
    # the oldest pending request was evicted (its 2 blocks were enough), not the owned one outside
    # the batch at that moment (back) nor the younger pending one
    assert (old.kv_len, old.table, old.status) == (0, [], "pending")
    assert (young.kv_len, len(young.table)) == (4, 1) and (back.kv_len, len(back.table)) == (4, 1)
    assert sch.preemptions == 1 and sch.blocks.num_free == 6 - 1 - 1 - 3


def test_owned_requests_outside_the_batch_are_evicted_newest_first():
    sch = make_scheduler(4)
    first, second, third = make_seq(0, 8), make_seq(1, 4), make_seq(2, 4)
    for s in (first, second, third):
        sch.add_owned(s)
    finish_step(sch.schedule(), new_token=False)  # 2 + 1 + 1 blocks: the pool is full
    first.tokens.append(7)  # 9 tokens: first needs a third block
    batch = sch.schedule()
    # first needs a third block: the newest owned request not in the batch (third) gives its block
    assert [s.rid for s in batch] == [0, 1]
    assert (third.status, third.kv_len, third.table) == ("waiting", 0, [])  # recomputed when it runs
    assert len(first.table) == 3 and len(second.table) == 1 and sch.preemptions == 1
    # blocks held by the batch are never taken: third waits for a later step, it is not unfit
    assert sch.unfit == [] and sch.blocks.num_free == 0
    sch.remove(second.rid)
    assert [s.rid for s in sch.schedule()] == [0, 2] and len(third.table) == 1


def test_a_request_larger_than_the_whole_pool_is_unfit_and_evicts_nothing():
    sch = make_scheduler(2)  # 8 tokens in all
    small, pending, huge = make_seq(0, 3), make_seq(1, 4), make_seq(2, 9)
    sch.add_owned(pending)
    finish_step(sch.schedule(), new_token=False)
    sch.set_pending(pending)
    sch.add_owned(huge)
    sch.add_owned(small)
    batch = sch.schedule()
    assert batch == [small] and sch.unfit == [huge]
    assert (pending.kv_len, len(pending.table)) == (4, 1) and sch.preemptions == 0  # nothing evicted for it
    assert huge.table == [] and huge.status == "waiting"
    sch.remove(huge.rid)
    sch.schedule()
    assert sch.unfit == []


def test_max_batch_tokens_skips_what_does_not_fit_and_lets_a_long_prompt_run_alone():
    sch = make_scheduler(64, max_batch_tokens=10)
    a, b, c = make_seq(0, 6), make_seq(1, 6), make_seq(2, 3)
    for s in (a, b, c):
        sch.add_owned(s)
    assert [s.rid for s in sch.schedule()] == [0, 2]  # 6 + 3 <= 10; b (6 more) waits
    assert b.table == [] and b.status == "waiting"
    sch2 = make_scheduler(64, max_batch_tokens=10)
    long = make_seq(3, 20)
    sch2.add_owned(long)
    sch2.add_owned(make_seq(4, 2))
    assert [s.rid for s in sch2.schedule()] == [3]  # longer than the budget: alone


def test_max_batch_size_takes_the_first_arrivals():
    sch = make_scheduler(64, max_batch_size=2)
    seqs = [make_seq(rid, 2) for rid in (9, 4, 6)]
    for s in seqs:
        sch.add_owned(s)
    batch = sch.schedule()
    assert [s.rid for s in batch] == [9, 4]
    assert seqs[2].table == [] and sch.blocks.num_free == 62


@pytest.mark.parametrize("status", ["owned", "pending"])
def test_remove_returns_every_block(status):
    sch = make_scheduler(8)
    s = make_seq(0, 13)
    sch.add_owned(s)
    finish_step(sch.schedule(), new_token=False)
    if status == "pending":
        sch.set_pending(s)
    assert sch.blocks.num_free == 8 - 4
    assert sch.remove(s.rid) is s and sch.remove(s.rid) is None
    assert sch.blocks.num_free == 8 and s.table == [] and sch.schedule() == []
