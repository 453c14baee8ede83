"""Per-model scheduler: which requests the next step runs, and KV block accounting.

A request on a model is one `Seq`. States:
- **owned** (``waiting`` until it first gets KV blocks, then ``running``): the model writes
  it; the next step feeds its unseen suffix ``tokens[kv_len:]`` (prefill, decode or extend).
- **pending**: handed off to a peer; out of scheduling; KV kept (``kv_len`` unchanged).

When the pool is full, pending requests lose their KV first (oldest first), then owned
requests not in the batch (newest first); each such eviction is a counted preemption and the
request is recomputed from token 0 when it next runs. A request that has outgrown the whole pool
can never run again: `Scheduler.schedule` lists it in ``unfit`` (the sub-server fails it with an
error naming the pool size), so no request waits forever for blocks.

With the prefix cache on, a request with no KV on this model (new, first visit after a handoff,
admission prefill, or preempted) first takes the longest run of cached blocks that holds its
tokens (`BlockAllocator.match`) and feeds only the rest; the full blocks a step completes are cached
after the step (`Scheduler.cache_blocks`). A request whose next block another request of the
same step is computing waits one step and then shares it (SGLang defers such requests the same
way), so two requests never compute one prefix side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...request import RequestConfig
from ..messages import RequestState, Stats
from .block_allocator import BlockAllocator, KVPoolFull
from .prefix_cache import chain_keys


@dataclass
class Seq:
    """One request on one model: its travelling `RequestState` and what stays here (KV, cache keys).

    Attributes:
        config: the request's immutable part.
        tokens: prompt + committed tokens this model knows, shape [n].
        request_state: its `RequestState`: what travels with it to the next model (seen counts, committed
            count, hop counters, policy state, forced span, greedy, peer logits).
        kv_len: how many of them are in this model's KV (invariant: KV holds tokens[:kv_len]).
        table: block table in this model's pool.
        status: waiting | running | pending.
        generator: its sampling generator on this model.
        prefill_only: prefilled at admission for a later handoff (``EngineConfig.prefill_peers``):
            a step feeds it but never samples or routes it; it then waits pending.
        resamples: `Resample` decisions in a row at the current position.
        keys: prefix-cache chain keys of the full blocks of ``tokens`` known so far.
        n_cached: leading blocks of ``table`` that hold final content and are shared through
            the prefix cache (matched, or cached after the step that filled them); the request
            never writes into them.
        reuse: whether a lookup in the prefix cache may stand in for feeding its tokens (False
            when a policy reads every prompt position's hidden state).
        arrived: its tokens on arrival here (with no KV) were counted in ``query_tokens``.
        prompt_len: its prompt's tokens on this model (the first ``prompt_len`` of ``tokens``).
        text: models that do not share a tokenizer: its `TextView` here (the committed bytes
            this model has seen, its token boundaries), else None.
    """

    config: RequestConfig
    tokens: list[int]
    request_state: RequestState = field(default_factory=RequestState)
    kv_len: int = 0
    table: list[int] = field(default_factory=list)
    status: str = "waiting"
    generator: torch.Generator | None = None
    prefill_only: bool = False
    resamples: int = 0
    keys: list = field(default_factory=list)
    n_cached: int = 0
    reuse: bool = True
    arrived: bool = False
    prompt_len: int = -1
    text: object = None

    def __post_init__(self):
        if self.prompt_len < 0:
            self.prompt_len = len(self.config.prompt_ids)

    @property
    def rid(self) -> int:
        return self.config.rid

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Scheduler:
    """Picks the next batch of one model.

    Args:
        blocks: the model's `BlockAllocator` (block ids over its runner's KV storage).
        max_batch_tokens: tokens fed per step at most (a longer single prompt still runs alone).
        max_batch_size: requests per step at most.
        prefix_cache: share full blocks of equal prefixes through the allocator's prefix cache.
        cache_hold: a request's last ``cache_hold`` tokens in KV are not cached yet (models that
            do not share a tokenizer re-encode the end of their tokens on a handoff; a rewind
            into a shared block would recompute the whole block).

    Attributes:
        hit_tokens, query_tokens: tokens reused from the prefix cache by the last `schedule`,
            and the tokens its requests brought on arrival with no KV here (new, first visit,
            admission prefill, preempted), counted with the cache off too.
        total_hit_tokens, total_query_tokens: the same, summed since the scheduler started.
    """

    def __init__(
        self,
        blocks: BlockAllocator,
        max_batch_tokens: int = 4096,
        max_batch_size: int = 256,
        prefix_cache: bool = False,
        cache_hold: int = 0,
    ):
        self.blocks, self.cache_hold = blocks, cache_hold
        if prefix_cache:
            blocks.enable_prefix_cache()
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.hit_tokens = self.query_tokens = 0
        self.total_hit_tokens = self.total_query_tokens = 0
        self._computing: set[bytes] = set()  # keys of blocks the batch being scheduled fills
        self.seqs: dict[int, Seq] = {}
        self.owned: dict[int, Seq] = {}  # insertion order = FIFO
        self.preemptions = 0
        self.unfit: list[Seq] = []  # the last `schedule`'s requests too big for the whole pool

    # -- state changes --------------------------------------------------------------------
    def add_owned(self, seq: Seq) -> None:
        self.seqs[seq.rid] = seq
        seq.status = "running" if seq.table else "waiting"
        self.owned[seq.rid] = seq

    def set_pending(self, seq: Seq) -> None:
        seq.status = "pending"
        self.owned.pop(seq.rid, None)

    def remove(self, rid: int) -> Seq | None:
        """Forget a request and free its blocks (on finish, abort or release)."""
        self.owned.pop(rid, None)
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.blocks.free(seq.table)
        return seq

    def drop_kv(self, seq: Seq) -> None:
        """Free ``seq``'s KV here (it is recomputed, or found in the prefix cache, when it next runs)."""
        self.blocks.free(seq.table)
        seq.kv_len = seq.n_cached = 0
        seq.arrived = False

    def rewind(self, seq: Seq, n: int) -> None:
        """Keep only the first ``n`` tokens of ``seq`` in KV, so the next step feeds from there. A
        shared (cached) block is never written: the request drops it and every block after it
        and recomputes from that block's start."""
        bs = self.blocks.block_size
        if n < seq.n_cached * bs:
            self.blocks.drop(seq.table, n // bs)
            seq.n_cached = n // bs
            n = seq.n_cached * bs
        seq.kv_len = min(seq.kv_len, n)

    def replaced_from(self, seq: Seq, n: int) -> None:
        """``seq.tokens`` changed from position ``n`` on (a re-encoding of its text): forget the
        prefix-cache keys of the blocks that hold those positions and keep only the first ``n``
        tokens in KV (`rewind`)."""
        del seq.keys[n // self.blocks.block_size :]
        if seq.kv_len > n:
            self.rewind(seq, n)

    def _evict(self, seq: Seq) -> None:
        self.drop_kv(seq)
        if seq.status == "running":
            seq.status = "waiting"
        self.preemptions += 1

    # -- prefix cache ---------------------------------------------------------------------
    def _reuse(self, seq: Seq) -> bool:
        """Extend ``seq``'s KV with cached blocks when all it holds is shared (a request with no
        KV here starts its lookup). False: its next block is being filled by a request of this
        batch; it waits a step to share it."""
        blocks = self.blocks
        if not seq.arrived and seq.kv_len == 0:
            seq.arrived = True
            self.query_tokens += len(seq.tokens)
            self.total_query_tokens += len(seq.tokens)
        if (
            blocks.cache is None
            or not seq.reuse
            or seq.kv_len != len(seq.table) * blocks.block_size
            or seq.n_cached != len(seq.table)
        ):
            return True
        limit = (len(seq.tokens) - 1) // blocks.block_size  # the last position is always fed: its block stays private
        start = seq.n_cached
        if start >= limit:
            return True
        got = blocks.match(seq.tokens, seq.keys, limit, start)
        self.hit_tokens += len(got) * blocks.block_size
        self.total_hit_tokens += len(got) * blocks.block_size
        seq.table.extend(got)
        seq.n_cached += len(got)
        seq.kv_len = seq.n_cached * blocks.block_size
        nxt = seq.n_cached
        return not (nxt < limit and nxt < len(seq.keys) and seq.keys[nxt] in self._computing)

    def _claim(self, seq: Seq) -> None:
        """Note the full blocks this step fills for ``seq`` (requests after it in the batch that
        need them wait a step)."""
        if self.blocks.cache is None:
            return
        full = len(seq.tokens) // self.blocks.block_size
        if full > seq.n_cached:
            chain_keys(seq.tokens, self.blocks.block_size, full, seq.keys)
            self._computing.update(seq.keys[seq.n_cached : full])

    def cache_blocks(self, batch: list[Seq]) -> None:
        """After a successful step: cache the blocks it filled (each request's full blocks of
        tokens now in KV)."""
        blocks = self.blocks
        self._computing.clear()
        if blocks.cache is None:
            return
        for seq in batch:
            full = max(0, seq.kv_len - self.cache_hold) // blocks.block_size
            if full > seq.n_cached:
                blocks.register(seq.table, seq.tokens, seq.keys, seq.n_cached, full)
                seq.n_cached = full

    # -- scheduling -----------------------------------------------------------------------
    def kv_error(self, seq: Seq, model: str) -> str:
        """Why ``seq`` cannot get its KV on ``model``: the pool is too small for it (`too_big`),
        or blocks are missing that no request of this scheduler holds (the pool is shared or
        leaked). Names the model, the request, the numbers and the fix."""
        blocks, have = self.blocks, self.blocks.capacity_tokens
        if not self.too_big(seq):
            return (
                f"KV pool of model '{model}' has {blocks.num_free} free blocks and request {seq.rid} needs "
                f"{blocks.blocks_for(len(seq.tokens)) - len(seq.table)} more, but no request of this model holds "
                f"the others: the pool is used by another engine (a runner object given to two Routers?) "
                f"or leaked; give each Router its own runners"
            )
        return (
            f"KV pool of model '{model}' is too small for request {seq.rid}: it needs {len(seq.tokens)} "
            f"tokens of KV, the pool holds {have} tokens; raise max_kv_tokens (Router(..., max_kv_tokens=...)), "
            f"lower max_new_tokens or shorten the prompt"
        )

    def stats(self, model: str, token: int = 0) -> Stats:
        """The KV pool and request counts of ``model``'s scheduler, as a `Stats` event
        (``token``: the query's, echoed)."""
        blocks, seqs, owned = self.blocks, self.seqs, self.owned
        run = sum(len(s.table) for s in owned.values())
        pend = sum(len(s.table) for r, s in seqs.items() if r not in owned)
        return Stats(
            model,
            token,
            blocks.num_free,
            blocks.num_blocks,
            blocks.block_size,
            len(owned),
            len(seqs) - len(owned),
            run,
            pend,
            cached_blocks=blocks.cached_blocks,
            idle_cached_blocks=blocks.idle_cached_blocks,
            prefix_hit_tokens=self.total_hit_tokens,
            prefix_query_tokens=self.total_query_tokens,
            prefix_cache=blocks.cache is not None,
        )

    def too_big(self, seq: Seq) -> bool:
        return self.blocks.blocks_for(len(seq.tokens)) > self.blocks.num_blocks

    def _reserve(self, seq: Seq, in_batch: set[int]) -> bool:
        while True:
            try:
                self.blocks.ensure(seq.table, len(seq.tokens))
                return True
            except KVPoolFull:
                pending = [s for s in self.seqs.values() if s.status == "pending" and s.table]
                others = [
                    s for s in reversed(self.owned.values()) if s.rid not in in_batch and s.rid != seq.rid and s.table
                ]
                victims = pending or others
                if not victims:
                    return False
                self._evict(victims[0])

    def schedule(self) -> list[Seq]:
        """The requests of the next step (possibly empty), first come first served. Requests
        that need more blocks than the whole pool holds are left out and listed in ``unfit``;
        one that only waits for blocks held by the batch runs in a later step."""
        batch: list[Seq] = []
        in_batch: set[int] = set()
        budget = self.max_batch_tokens
        self.unfit = []
        self.hit_tokens = self.query_tokens = 0
        self._computing.clear()
        for seq in list(self.owned.values()):
            if len(batch) >= self.max_batch_size:
                break
            if self.too_big(seq):
                self.unfit.append(seq)
                continue
            if not self._reuse(seq):
                continue
            need = len(seq.tokens) - seq.kv_len
            if batch and need > budget:
                continue
            if not self._reserve(seq, in_batch):
                if not batch:  # nothing here holds a block it could give: waiting would never end
                    self.unfit.append(seq)
                continue
            self._claim(seq)
            seq.status = "running"
            batch.append(seq)
            in_batch.add(seq.rid)
            budget -= need
        return batch
