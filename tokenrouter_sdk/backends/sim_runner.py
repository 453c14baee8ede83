"""The simulated backend: a runner whose step takes the time a latency model says, and a
transport that runs the real sub-servers and engine in simulated (not slept) time.

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
import contextlib
import heapq
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.kv_pool import KVPool


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

    def __init__(self, latency: LatencyModel | None = None, *, vocab_size: int = 259, max_kv_tokens: int = 1 << 20,
                 block_size: int = 16, max_context: int = 1 << 20, seed: int = 0):
        self.latency = latency or LatencyModel()
        self.vocab_size, self.max_context, self.seed = vocab_size, max_context, seed
        self.pool = KVPool(1, 1, 1, -(-max_kv_tokens // block_size), block_size)
        self.last_forward_s = 0.0
        self.advance: Callable[[float], None] = lambda dt: None  # set by SimTransport

    def forward(self, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.tensor([(s.tokens[-1] * 1_000_003 + (s.start + len(s.tokens)) * 7919 + self.seed) % (2**31)
                             for s in seqs], dtype=torch.float32)
        # cheap deterministic logits: a scrambled function of (key, vocab index)
        v = torch.arange(self.vocab_size, dtype=torch.float32)
        logits = torch.sin(keys[:, None] * 0.618 + v[None, :] * 12.9898) * 4.0
        dt = self.latency.seconds(len(seqs), sum(len(s.tokens) for s in seqs))
        self.last_forward_s = dt
        self.advance(dt)
        return logits, torch.zeros(len(seqs), 1)


class SimTransport:
    """Runs the sub-servers and the engine's event handler in one background thread, in
    simulated time (seconds from 0). Same interface as `ThreadTransport`."""

    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self._busy: dict[str, float] = {}
        self._local: dict[str, float] = {}
        self._stepping: str | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._held = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def hold(self):
        """Freeze simulated time while the engine submits a batch (all of it arrives at once)."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify()

    def clock(self) -> float:
        return self.now

    def clock_for(self, model: str) -> Callable[[], float]:
        return lambda: self._local.get(model, self.now) if self._stepping == model else self.now

    def _t(self) -> float:
        return self._local[self._stepping] if self._stepping is not None else self.now

    def send(self, model: str, msg) -> None:
        with self._cv:
            heapq.heappush(self._heap, (self._t(), next(self._seq), model, msg))
            self._cv.notify()

    def emit(self, event) -> None:
        with self._cv:
            heapq.heappush(self._heap, (self._t(), next(self._seq), None, event))

    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        from ..engine.subserver import SubServer
        self.subservers = {name: SubServer(**spec, send=self.send, emit=self.emit, clock=self.clock_for(name))
                           for name, spec in specs.items()}
        self._on_event = on_event
        for name, ss in self.subservers.items():
            self._busy[name] = 0.0
            ss.runner.advance = self._advancer(name)
        self._thread = threading.Thread(target=self._loop, name="tokenrouter-sim", daemon=True)
        self._thread.start()

    def _advancer(self, name: str):
        def advance(dt: float) -> None:
            self._local[name] = self.now + dt
        return advance

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._held and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                due = [heapq.heappop(self._heap) for _ in range(len(self._heap))
                       if self._heap and self._heap[0][0] <= self.now]
            for _, _, dest, msg in due:
                if dest is None:
                    self._on_event(msg)
                else:
                    self.subservers[dest].handle(msg)
            ran = False
            for name, ss in self.subservers.items():
                if self._busy[name] <= self.now:
                    self._stepping, self._local[name] = name, self.now
                    try:
                        if ss.try_step():
                            self._busy[name] = self._local[name]
                            ran = True
                    finally:
                        self._stepping = None
            if due or ran:
                continue
            with self._cv:
                nxt = [t for t in self._busy.values() if t > self.now]
                if self._heap:
                    nxt.append(self._heap[0][0])
                if nxt:
                    self.now = max(self.now, min(nxt))
                elif not self._closed:
                    self._cv.wait(0.05)  # idle: wait for the engine to submit

    def alive(self, model: str) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
