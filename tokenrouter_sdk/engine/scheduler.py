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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..request import RequestConfig
from .kv_pool import KVPool, KVPoolFull


@dataclass
class Seq:
    """One request's state on one model.

    Attributes:
        tokens: prompt + committed tokens this model knows, shape [n].
        kv_len: how many of them are in this model's KV (invariant: KV holds tokens[:kv_len]).
        table: block table in this model's pool.
        seen: per model, how many tokens of prompt + committed it has seen.
        greedy: decode greedily until the next handoff (`Handoff.greedy`).
        peer_logits: the handing-off model's logits [V] for the next position, until the next
            step here (``Needs(handoff_logits=True)``).
        prefill_only: prefilled at admission for a later handoff (``EngineConfig.prefill_peers``):
            a step feeds it but never samples or routes it; it then waits pending.
        resamples: `Resample` decisions in a row at the current position.
    """

    config: RequestConfig
    tokens: list[int]
    kv_len: int = 0
    table: list[int] = field(default_factory=list)
    status: str = "waiting"
    seen: dict[str, int] = field(default_factory=dict)
    n_committed: int = 0
    hops: int = 0
    hops_since_commit: int = 0
    discarded: int = 0
    state: dict = field(default_factory=dict)
    span: int | None = None
    return_to: str | None = None
    generator: torch.Generator | None = None
    greedy: bool = False
    peer_logits: torch.Tensor | None = None
    prefill_only: bool = False
    resamples: int = 0

    @property
    def rid(self) -> int:
        return self.config.rid

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.config.prompt_ids):]


class Scheduler:
    """Picks the next batch of one model.

    Args:
        pool: the model's KV pool.
        max_batch_tokens: tokens fed per step at most (a longer single prompt still runs alone).
        max_batch_size: requests per step at most.
    """

    def __init__(self, pool: KVPool, max_batch_tokens: int = 4096, max_batch_size: int = 256):
        self.pool = pool
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
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
            self.pool.free(seq.table)
        return seq

    def _evict(self, seq: Seq) -> None:
        self.pool.free(seq.table)
        seq.kv_len = 0
        if seq.status == "running":
            seq.status = "waiting"
        self.preemptions += 1

    # -- scheduling -----------------------------------------------------------------------
    def too_big(self, seq: Seq) -> bool:
        return self.pool.blocks_for(len(seq.tokens)) > self.pool.num_blocks

    def _reserve(self, seq: Seq, in_batch: set[int]) -> bool:
        while True:
            try:
                self.pool.ensure(seq.table, len(seq.tokens))
                return True
            except KVPoolFull:
                pending = [s for s in self.seqs.values() if s.status == "pending" and s.table]
                others = [s for s in reversed(self.owned.values()) if s.rid not in in_batch and s.rid != seq.rid
                          and s.table]
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
        for seq in list(self.owned.values()):
            if len(batch) >= self.max_batch_size:
                break
            if self.too_big(seq):
                self.unfit.append(seq)
                continue
            need = len(seq.tokens) - seq.kv_len
            if batch and need > budget:
                continue
            if not self._reserve(seq, in_batch):
                if not batch:  # nothing here holds a block it could give: waiting would never end
                    self.unfit.append(seq)
                continue
            seq.status = "running"
            batch.append(seq)
            in_batch.add(seq.rid)
            budget -= need
        return batch
