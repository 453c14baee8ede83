"""Core lending: the CPU cores of one machine shared by the sub-server processes of one Router,
so that a model computes on every core while its peers have nothing to run.

Why: routed generation at low concurrency runs one model at a time (a request is pending on
one model while the other writes), so with a fixed share of the cores per process (cores /
models) half of a 2-core machine idles through a routed answer; with every process on all
cores, two busy models oversubscribe the cores and every step slows down several times
(OpenMP teams spin-wait for each other). Lending gives a lone busy model every core and two
busy models a share each (measured in ``docs/benchmarks.md``, "Core lending (cores)").

How: each sub-server process marks itself busy in a small shared file (one byte per model)
before a step and idle before it waits for messages; before each step it takes ``cores //
busy`` threads (the first ``cores % busy`` busy models one more) with ``torch.set_num_threads``.
A model that finds its cores held by a peer marks that it waits for them, and the peer gives
them back between two layers of its step (`CoreShare.give_back`, the runner's
``between_layers``), so the wait lasts about a layer, not a step. Each process writes only its
own entries: no lock.
"""

from __future__ import annotations

import mmap
import os
import time


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def create_flags(path: str, models: int) -> None:
    """Write the shared file at ``path``: ``models`` flags (bytes, 0 = idle, else the threads
    held), then per model the time it last went idle (float64, ``time.monotonic``, the same
    clock in every process) and the requests it held then (float64)."""
    with open(path, "wb") as f:
        f.write(bytes(_size(models)))


def _size(models: int) -> int:
    return max(1, models) + 16 * max(1, models)


WANTS = 255  # a flag value: busy, waiting for cores (holds none yet)


class CoreShare:
    """One sub-server process's view of the shared flags (see the module docstring).

    Args:
        path: the flags file (`create_flags`).
        index: this model's byte.
        models: bytes in the file.
        cores: the cores shared, >= 1.
        wait_s: seconds `busy` waits at most for a peer to give cores back before it computes
            anyway (a peer that died holding cores must not stall this one).
        settle_s: a peer idle for less than this still counts as busy (it often gets work back
            at once: a handoff's return, the next batch), so a short gap does not move cores to
            and fro.
        set_threads: what sets this process's thread count (``torch.set_num_threads``).

    Attributes:
        threads: the torch thread count this process last set.
    """

    def __init__(
        self,
        path: str,
        index: int,
        models: int,
        cores: int,
        wait_s: float = 0.2,
        settle_s: float = 0.02,
        set_threads=None,
    ):
        self.path, self.index, self.models, self.cores = path, index, models, max(1, int(cores))
        self.wait_s, self.settle_s, self.set_threads = wait_s, settle_s, set_threads
        self.threads = 0
        self._mm: mmap.mmap | None = None
        self._since = self._held = None

    def __getstate__(self):
        return dict(self.__dict__, _mm=None, _since=None, _held=None, threads=0)

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            with open(self.path, "r+b") as f:
                self._mm = mmap.mmap(f.fileno(), _size(self.models))
            n = self.models
            self._since = memoryview(self._mm)[n : n + 8 * n].cast("d")
            self._held = memoryview(self._mm)[n + 8 * n : n + 16 * n].cast("d")
        return self._mm

    def share(self) -> tuple[int, int]:
        """(this model's share of the cores among the busy models: ``cores // busy``, plus one
        for the first ``cores % busy`` by index; the cores no peer holds now). A peer idle for
        less than ``settle_s`` that holds more than one request counts as busy (one of them is
        likely back within a step); one that holds a single request handed it over and waits
        for it (at one request in flight the models take turns)."""
        flags = list(self._map()[: self.models])
        now = time.monotonic()
        for j, b in enumerate(flags):
            if not b and j != self.index and self._held[j] > 1 and now - self._since[j] < self.settle_s:
                flags[j] = WANTS
        busy = 1 + sum(1 for j, b in enumerate(flags) if b and j != self.index)
        rank = sum(1 for b in flags[: self.index] if b)
        held = sum(b for j, b in enumerate(flags) if j != self.index and b != WANTS)
        return max(1, self.cores // busy + (1 if rank < self.cores % busy else 0)), self.cores - held

    def busy(self) -> None:
        """Mark this model busy and set this process's torch threads to its share, once the
        peers hold no more than theirs (a peer at work on more cores gives them back at its
        next step; this waits for that, at most ``wait_s``)."""
        mm = self._map()
        want, free = self.share()
        if free < want:
            mm[self.index] = WANTS
            deadline = time.monotonic() + self.wait_s
            while time.monotonic() < deadline:
                time.sleep(0.0002)
                want, free = self.share()
                if free >= want:
                    break
        mm[self.index] = min(want, WANTS - 1)
        if want != self.threads:
            if self.set_threads is None:
                import torch

                self.set_threads = torch.set_num_threads
            self.set_threads(want)
            self.threads = want

    @property
    def lends(self) -> bool:
        """Whether cores can move between models: more than one model and more than one core.
        Otherwise `give_back` never gives anything, and the runner needs no call between layers
        (its step then runs every layer in one call where it can:
        `tokenrouter_sdk.backends.fused_layers.LayerCalls.run_stack`)."""
        return self.models > 1 and self.cores > 1

    def give_back(self) -> None:
        """Called between layers of a step (`TorchRunner.between_layers`): when this process
        holds more threads than its share and a peer waits for cores, drop to the share now,
        so the peer starts within a layer instead of after the whole step."""
        if self.threads <= 1 or self._mm is None:
            return
        flags = self._mm[: self.models]
        if WANTS not in flags:
            return
        want, _ = self.share()
        if want < self.threads:
            self._mm[self.index] = min(want, WANTS - 1)
            self.set_threads(want)
            self.threads = want

    def idle(self, held: int = 0) -> None:
        """Mark this model idle (it waits for messages; ``held``: the requests it holds,
        pending): its cores go to the busy peers."""
        if self._mm is not None or os.path.exists(self.path):
            mm = self._map()
            if mm[self.index]:
                self._since[self.index] = time.monotonic()
                self._held[self.index] = held
                mm[self.index] = 0

    def close(self) -> None:
        if self._mm is not None:
            self._since.release()
            self._held.release()
            self._mm.close()
            self._mm = None
