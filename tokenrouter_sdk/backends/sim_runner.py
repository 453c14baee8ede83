"""The simulated backend: a runner whose step takes the time a latency model says. With
`tokenrouter_sdk.engine.transports.sim_transport.SimTransport` the real sub-servers and engine run in
simulated (not slept) time.

It is the test bed for the scheduler and the planner: the same `SubServer` code (scheduling,
KV accounting, policy calls, delayed batching) runs, but a forward costs no compute and the
clock jumps from event to event, so N = 256 requests run in seconds.

Simulation rule (a conservative discrete-event simulation): a sub-server that can step at
simulated time t starts a step; its forward returns at once but the model is busy until
t + latency(batch); every message and event it produces in that step is delivered at
t + latency. Messages from the engine are delivered at the current time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from ..engine.runner import ForwardOut, PoolShape


@dataclass
class LatencyModel:
    """Step latency of one model as a function of the batch.

    ``seconds(batch_size, tokens_fed)`` = linear interpolation of ``table`` (batch size ->
    seconds per decode step, measured by `tokenrouter_sdk.planner.profile_latency` or given),
    extrapolated linearly past its ends, plus ``per_token_s`` for every fed token beyond one
    per request (prefill and extend cost).

    Attributes:
        table: {batch_size: seconds}, at least one entry.
        per_token_s: extra seconds per extra fed token.
    """

    table: dict[int, float] = field(default_factory=lambda: {1: 0.060, 8: 0.110, 16: 0.155})
    per_token_s: float = 0.0005

    def __post_init__(self):
        if not self.table:
            raise ValueError("LatencyModel.table needs at least one {batch_size: seconds} entry")
        self._b = sorted(int(b) for b in self.table)
        self._t = [float(self.table[b]) for b in self._b]

    def step_s(self, batch_size: int) -> float:
        """Seconds of a decode step of ``batch_size`` requests."""
        b, t = self._b, self._t
        if len(b) == 1:
            return t[0]
        i = min(max(bisect.bisect_left(b, batch_size), 1), len(b) - 1)
        b0, b1, t0, t1 = b[i - 1], b[i], t[i - 1], t[i]
        return max(1e-6, t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0))

    def seconds(self, batch_size: int, tokens_fed: int) -> float:
        return self.step_s(batch_size) + self.per_token_s * max(0, tokens_fed - batch_size)


class SimRunner:
    """A runner with the `TorchRunner` interface and no model.

    Logits are pseudo-random but deterministic in (seed, last fed token, position), so the
    same workload gives the same tokens; a real `KVPool` (1 layer, 1 head, dim 1) keeps the
    block accounting honest.

    Args:
        latency: the `LatencyModel`.
        vocab_size: logits width V (keep it small: sampling cost is real).
        max_kv_tokens, block_size: KV pool size.
        max_context: context length in tokens.
        seed: token draws.
    """

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        vocab_size: int = 259,
        max_kv_tokens: int = 1 << 20,
        block_size: int = 16,
        max_context: int = 1 << 20,
        seed: int = 0,
    ):
        self.latency = latency or LatencyModel()
        self.vocab_size, self.max_context, self.seed = vocab_size, max_context, seed
        self.pool = PoolShape(-(-max_kv_tokens // block_size), block_size)  # no KV kept: its geometry only
        self.last_forward_s = 0.0

    def forward(self, seqs) -> ForwardOut:
        keys = torch.tensor(
            [(s.tokens[-1] * 1_000_003 + (s.start + len(s.tokens)) * 7919 + self.seed) % (2**31) for s in seqs],
            dtype=torch.float32,
        )
        # cheap deterministic logits: a scrambled function of (key, vocab index)
        v = torch.arange(self.vocab_size, dtype=torch.float32)
        logits = torch.sin(keys[:, None] * 0.618 + v[None, :] * 12.9898) * 4.0
        dt = self.latency.seconds(len(seqs), sum(len(s.tokens) for s in seqs))
        self.last_forward_s = dt  # simulated seconds: the sim transport's step length
        return ForwardOut(logits, torch.zeros(len(seqs), 1))
