"""KV reservation at admission: how many KV blocks each admitted request holds back per model.

With ``kv_admission="reserve"`` (the default) the engine admits a request only when every
model's pool can hold what the requests in flight and it may grow to (prompt +
``max_new_tokens``), so a running request is never preempted for lack of blocks. With the
prefix cache, the full prompt blocks before a prompt's last position are counted once for all
requests in flight that hold them (`chain_keys` names them), since a request reuses them as
soon as the first has filled them; the rest is the request's own.

Locking: not thread-safe; the engine calls it under its lock.
"""

from __future__ import annotations

import collections

from ..core.prefix_cache import chain_keys


class KVReservation:
    """Blocks reserved per model by the requests in flight.

    Args:
        capacity: model -> (usable blocks, tokens per block).
        max_context: tokens a request can reach at most.
        prefix_cache: whether shared prompt blocks are counted once.
    """

    def __init__(self, capacity: dict[str, tuple[int, int]], max_context: int, prefix_cache: bool):
        self.capacity, self.max_context, self.prefix_cache = dict(capacity), int(max_context), bool(prefix_cache)
        self.reserved = {m: 0 for m in capacity}  # blocks of requests' own, per model
        self.shared = {m: collections.Counter() for m in capacity}  # prompt block key -> requests holding it

    def need(self, ids, max_new_tokens: int) -> tuple[dict[str, int], dict[str, list]]:
        """Per model, (blocks of the request's own, prefix-cache keys of the prompt blocks it may
        share) for a prompt ``ids`` growing by up to ``max_new_tokens`` tokens. ``ids``: the
        prompt's token ids, or per model its own (models that do not share a tokenizer; their
        output is counted as ``max_new_tokens`` tokens on each, an estimate: a model's tokens of
        the text may be more than the unit model's, and a request that outgrows its reservation
        takes free blocks or preempts)."""
        need, shared = {}, {}
        per_model = isinstance(ids, dict)
        for m, (_, bs) in self.capacity.items():
            if per_model:
                ids_m = ids[m]
            else:
                ids_m = ids
            tokens = min(len(ids_m) + max_new_tokens, self.max_context)
            n_shared = max(0, min(len(ids_m) - 1, tokens) // bs) if self.prefix_cache else 0
            need[m] = -(-tokens // bs) - n_shared
            shared[m] = chain_keys(ids_m, bs, n_shared) if n_shared else []
        return need, shared

    def fits(self, need: dict[str, int], shared: dict[str, list]) -> bool:
        """Whether a request of this ``need``/``shared`` fits beside the ones reserved."""
        return all(
            self.reserved[m] + len(self.shared[m]) + need[m] + sum(1 for k in shared[m] if k not in self.shared[m])
            <= self.capacity[m][0]
            for m in self.capacity
        )

    def reserve(self, need: dict[str, int], shared: dict[str, list]) -> None:
        """Count an admitted request's blocks."""
        for m in self.capacity:
            self.reserved[m] += need[m]
            self.shared[m].update(shared[m])

    def release(self, need: dict[str, int], shared: dict[str, list]) -> None:
        """Uncount an ended request's blocks."""
        for m in self.capacity:
            self.reserved[m] -= need[m]
            counts = self.shared[m]
            for k in shared[m]:
                counts[k] -= 1
                if counts[k] <= 0:
                    del counts[k]
