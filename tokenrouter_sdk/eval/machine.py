"""What the machine did while a sweep timed a run: CPU seconds of this process and its
descendants (the engine, sub-server processes, tensor-parallel ranks), CPU seconds of every
other process, and the load average, read from ``/proc`` (Linux; elsewhere only the load
average and this process's own CPU time).

``with CpuWindow() as w: ...`` then ``w.record()``: ``cpu_s`` (ours), ``other_cpu_s``,
``other_cores`` (other processes' CPU seconds per wall second, i.e. cores they kept busy),
``other_share`` (of the machine's CPUs), ``load_1m`` (at the start) and ``cpus``. Sub-servers
in Ray actors are not descendants of this process: their CPU time counts as other processes'.
"""

from __future__ import annotations

import os
import time

HIGH_OTHER_SHARE = 0.10  # other processes' share of the CPUs above which a timing is flagged as taken under load


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _tick() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover
        return 100.0


def _tree_cpu_ticks(root: int) -> int | None:
    """utime + stime (clock ticks) of ``root`` and its descendants; None without /proc."""
    table: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
            table[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
    if root not in table:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += table[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def _machine_busy_ticks() -> int | None:
    """Busy clock ticks of every CPU since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat", "rb") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != b"cpu":
        return None
    v = [int(x) for x in parts[1:9]]
    return v[0] + v[1] + v[2] + v[5] + v[6] + v[7]


class CpuWindow:
    """CPU time of this process tree and of the other processes over a ``with`` block."""

    def __enter__(self) -> "CpuWindow":
        self.load_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self._t0 = time.perf_counter()
        self._own0 = _tree_cpu_ticks(os.getpid())
        self._proc0 = time.process_time()
        self._busy0 = _machine_busy_ticks()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        own1, busy1, tick = _tree_cpu_ticks(os.getpid()), _machine_busy_ticks(), _tick()
        if self._own0 is not None and own1 is not None:
            self.cpu_s = (own1 - self._own0) / tick
        else:
            self.cpu_s = time.process_time() - self._proc0
        if self._busy0 is not None and busy1 is not None and self._own0 is not None and own1 is not None:
            self.other_cpu_s = max(0.0, (busy1 - self._busy0) / tick - self.cpu_s)
        else:
            self.other_cpu_s = None

    def record(self) -> dict:
        """The window's numbers (see the module docstring)."""
        n = cpus()
        other = self.other_cpu_s
        cores = other / self.wall_s if other is not None and self.wall_s > 0 else None
        return {
            "cpu_s": self.cpu_s,
            "other_cpu_s": other,
            "other_cores": cores,
            "other_share": cores / n if cores is not None else None,
            "load_1m": self.load_1m,
            "cpus": n,
        }


def load_summary(runs: list[dict]) -> dict:
    """The machine's load over a sweep's timed runs: the median and largest share of the CPUs
    other processes used, the largest load average at a run's start (it counts this sweep's own
    threads too), and whether the runs were taken under load (``high``: other processes used
    more than `HIGH_OTHER_SHARE` of the CPUs in the median run)."""
    import statistics

    shares = [r["other_share"] for r in runs if r.get("other_share") is not None]
    loads = [r["load_1m"] for r in runs if r.get("load_1m") is not None]
    n = cpus()
    med = statistics.median(shares) if shares else None
    peak_load = max(loads) if loads else None
    high = med is not None and med > HIGH_OTHER_SHARE
    return {
        "cpus": n,
        "other_share_median": med,
        "other_share_max": max(shares) if shares else None,
        "load_1m_max": peak_load,
        "high": bool(high),
        "threshold_share": HIGH_OTHER_SHARE,
    }
