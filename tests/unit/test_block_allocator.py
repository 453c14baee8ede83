"""KV allocation apart from KV storage: the sub-server's `BlockAllocator` hands out block ids
over the geometry a runner reports, and the runner keeps its own storage. A runner that is not
ours (its storage is a tensor of token ids, its forward a full recompute from what that storage
holds) serves a routed run equal to the reference, so block ids are the whole KV contract."""

import pytest
import torch

from tokenrouter_sdk import Router, SamplingParams
from tokenrouter_sdk.engine.core.block_allocator import BlockAllocator, KVPoolFull, blocks_of
from tokenrouter_sdk.engine.runner import ForwardOut, PoolShape, Runner
from tokenrouter_sdk.engine.transports import wire
from tokenrouter_sdk.models import tiny_model, truncate
from tokenrouter_sdk.policies import RandomRouting
from tokenrouter_sdk.reference import reference_generate

from ..helpers import mixed_prompts, pools_free


class TokenSlotRunner:
    """A runner written against the protocol alone: its KV storage holds the token id of each
    slot (block b, offset o: ``b * block_size + o``), and a step recomputes each request from
    the tokens its block table's slots hold. Two requests given one block, or a table that
    misses a position, change what it computes."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model, self.pool = model, PoolShape(num_blocks, block_size)
        self.storage = torch.full((num_blocks * block_size,), -1, dtype=torch.long)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = model.config.max_position_embeddings
        self.device = torch.device("cpu")
        self.last_forward_s = 0.0

    def _slot(self, table, p):
        return table[p // self.pool.block_size] * self.pool.block_size + p % self.pool.block_size

    @torch.inference_mode()
    def forward(self, seqs):
        logits, hidden = [], []
        for s in seqs:
            for i, t in enumerate(s.tokens):
                self.storage[self._slot(s.table, s.start + i)] = t
            ids = torch.tensor([int(self.storage[self._slot(s.table, p)]) for p in range(s.start + len(s.tokens))])
            assert (ids >= 0).all(), "a position's slot was never written"
            h = self.model.get_decoder()(input_ids=ids[None]).last_hidden_state[0, -1]
            hidden.append(h)
            logits.append(self.model.get_output_embeddings()(h))
        return ForwardOut(torch.stack(logits), torch.stack(hidden))


@pytest.fixture(scope="module")
def models():
    large = tiny_model(num_layers=2, seed=31)
    return {"small": truncate(large, 1), "large": large}


def test_a_runner_with_its_own_kv_storage_serves_a_routed_run_equal_to_the_reference(models, tok):
    runners = {n: TokenSlotRunner(m, num_blocks=24, block_size=4) for n, m in models.items()}
    assert all(isinstance(r, Runner) for r in runners.values())
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    policy = RandomRouting(p=0.4, seed=2)
    with Router(runners, policy, tokenizer=tok) as r:
        outs = r.generate(mixed_prompts(5, seed=4), sampling=params, concurrency=4, timeout=120)
        assert all(free == usable for free, usable in pools_free(r).values())
    for o in outs:
        assert o.finish_reason == "length", o.error
        ref = reference_generate(models, o.prompt, policy, params, rid=o.rid)
        assert (o.token_ids, o.token_models) == (ref["token_ids"], ref["token_models"]), f"rid {o.rid}"
    assert {m for o in outs for m in o.token_models} == {"small", "large"}
    assert all((r.storage >= 0).any() for r in runners.values())


def test_the_allocator_hands_out_each_block_to_one_table_and_takes_it_back():
    blocks = BlockAllocator(4, 2)
    a, b = [], []
    blocks.ensure(a, 3)
    blocks.ensure(b, 4)
    assert sorted(a + b) == [0, 1, 2, 3] and blocks.num_free == 0 and blocks.capacity_tokens == 8
    with pytest.raises(KVPoolFull):
        blocks.ensure(a, 5)
    assert len(a) == 2
    blocks.free(a)
    assert a == [] and blocks.num_free == 2 and blocks.refs == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockAllocator(0, 4)


def test_sub_servers_over_one_runner_object_share_its_allocator(models):
    runner = TokenSlotRunner(models["large"], num_blocks=6, block_size=4)
    first = blocks_of(runner)
    assert blocks_of(runner) is first and (first.num_blocks, first.block_size) == (6, 4)
    runner.pool = PoolShape(10, 4)  # another storage: another allocator
    assert blocks_of(runner) is not first and blocks_of(runner).num_blocks == 10


def test_a_runner_object_reaches_its_process_without_this_process_allocator(models):
    runner = TokenSlotRunner(models["large"], num_blocks=6, block_size=4)
    t = []
    blocks_of(runner).ensure(t, 9)
    child = wire._child_spec({"runner": runner})["runner"]
    assert "kv_blocks" not in child.__dict__ and blocks_of(child).num_free == 6
    assert blocks_of(runner).num_free == 3  # this process's is untouched
