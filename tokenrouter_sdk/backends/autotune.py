"""Choices of the CPU step made by measuring the candidates on the machine itself, at first use,
on the model's own weights, and kept on disk per machine and library versions.

The fastest way to run a projection depends on the CPU, oneDNN's version and the shapes, so
every choice is measured where it runs (what it measured on the CPUs this project ran on:
``docs/benchmarks.md``, "CPU step choices (autotune)").

What is chosen: for each group of projections of one shape and dtype (a model's merged q/k/v of
every layer, o, gate/up, down, the LM head), per row bucket (`BUCKETS`, the tokens of a step),
whether the oneDNN-packed weight, the model's own (``F.linear``) or, once the C++ CPU kernels are
loaded, the few-row kernel over its own packed weight (``csrc/skinny_gemm.cpp``, float32) runs. A
row count between two buckets takes the next larger bucket's choice; past the last, the last's.

How it is measured: one pass runs the group's projections over enough layers that their weights
are at least twice the last-level cache (so the weights stream from memory, as in a real step;
all layers when the model is smaller), at each bucket, packed and plain passes interleaved, the
median of `REPS` (`measure_group`); packed wins a bucket when its median is lower.

The few-row kernel wins a bucket when its median is within `SKINNY_MARGIN` of the faster of the
other two, or within `SKINNY_SLACK_MS` a projection of it, not only below it (`skinny_edge`),
its time at a bucket being the least measured there or at any larger bucket
(`kernel_ms_by_rows`): a layer whose projections all run the kernel at a step's row count runs
as one C++ call, and a step whose every layer does runs as one
(`tokenrouter_sdk.backends.fused_layers`), a saving the per-projection timings do not see.

Where it is kept: ``<torch extension root>/tokenrouter/choices/<machine key>.json`` beside the
compiled kernels (`tokenrouter_sdk.backends.cpu_kernels.build_directory`), keyed by the CPU model,
its flags, the last-level cache size, the threads, torch's and oneDNN's versions and the build of
the engine's own kernels (`machine_fields`); in ``$TOKENROUTER_CHOICES_DIR/<machine key>.json``
where that is set (the test suite keeps its tiny models' choices there, out of the user's).
One process measures at a time (an OS lock on the folder); a file that is corrupt or belongs to
another machine or version is ignored, measured again and overwritten; a folder that cannot be
written gives choices measured and not stored. `tokenrouter info` prints the choices and the
timings behind them (`report`). Other modules keep their own measured choices in the same file
(`choose`).

Forcing: ``TOKENROUTER_PACKING=packed``, ``plain`` or ``skinny`` (every bucket; ``skinny`` where
the kernels are loaded, packed until then), ``auto`` (measure; the default). The value is read at
each model's first step; any other value raises ValueError naming the accepted ones.

The few-row kernel's prefetch locality (``__builtin_prefetch``: 0 non-temporal, 2 into L2)
changes its speed, never its bits, and which is faster depends on the CPU and the row count: it
is measured once per machine and model size, before the paths whose kernel timings use it
(`tune_prefetch`, `measure_prefetch`), chosen apart for few-row and many-row steps (`Prefetch`),
and stored under `prefetch_key` (each model size keeps its own: a model that fits the caches
measures a tie that says nothing of one that streams from memory);
``TOKENROUTER_SKINNY_PREFETCH=0..3`` forces it.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

PACKING_ENV = "TOKENROUTER_PACKING"
CHOICES_ENV = "TOKENROUTER_CHOICES_DIR"  # a folder for the choices files instead of the kernels' build root
PACKING_VALUES = ("auto", "packed", "plain", "skinny")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
REPS = 3
PREFETCH_ENV = "TOKENROUTER_SKINNY_PREFETCH"
PREFETCH_HINTS = (0, 2)  # the candidates: non-temporal (prefetchnta), into L2 (prefetcht1)
PREFETCH_NAMES = {0: "non-temporal", 1: "into L3", 2: "into L2", 3: "into L1"}
PREFETCH_ROWS = (1, 8)  # the row counts measured: `Prefetch.few` at the first, `Prefetch.many` at the second
PREFETCH_MANY_FROM = 3  # steps of this many rows or more take `Prefetch.many` (3 is nearer 8 than 1 in ratio)
PREFETCH_MIN_BYTES = 512 << 20  # the weights a prefetch measurement streams at least (all, if fewer)
PREFETCH_REPS = 7  # timed passes per locality and row count: two localities' streams differ by a few %
PREFETCH_TIE = ((0, 2), 0.05)  # a tie (within 5%) at 1 row goes to non-temporal, at 8 to into L2 (`measure_prefetch`)
PREFETCH_KEY = "skinny prefetch float32"  # the prefix of a stored prefetch choice's key (`prefetch_key`)
FORMAT = 7  # the layout and rules of a choices file; a file of another format is measured again
# the few-row kernel is chosen where it is within this factor of the fastest path: where every
# projection of a layer takes it, the layer runs as one C++ call (`fused_layers`)
SKINNY_MARGIN = 1.05
SKINNY_SLACK_MS = 0.01  # ... or within this many ms a projection (a layer's or a step's one call saves more)


def skinny_edge(best_ms: float, projections: int) -> float:
    """The most a pass of the few-row kernel over ``projections`` projections may take (ms) and
    still be chosen, when the faster of the other two paths takes ``best_ms``: within
    `SKINNY_MARGIN` of it or `SKINNY_SLACK_MS` a projection of it, whichever is larger."""
    return max(SKINNY_MARGIN * best_ms, best_ms + SKINNY_SLACK_MS * projections)


def kernel_ms_by_rows(skinny_ms: list[float]) -> list[float]:
    """The few-row kernel's time (ms) at each bucket of ascending row counts, as the least
    measured at that bucket or any larger one. A step of fewer rows streams the same weights
    with fewer multiply-adds (and the prefetch measured fastest at its size, `Prefetch`), so it
    takes no longer; a bucket measured slower than a larger one met the machine's noise (a
    memory that changes rate during the measurement), which would otherwise put that bucket's
    steps off the kernel and onto the Python layer loop."""
    return list(itertools.accumulate(reversed(skinny_ms), min))[::-1]


class Prefetch(NamedTuple):
    """The few-row kernel's prefetch locality (0..3, as ``__builtin_prefetch``'s: 0 non-temporal,
    2 into L2; it changes speed, never bits) by step size: ``few`` for steps of fewer than
    `PREFETCH_MANY_FROM` rows, ``many`` from it. Measured per machine (`tune_prefetch`): one
    CPU can stream fastest with one locality at one row and with another at eight."""

    few: int = 0
    many: int = 0

    def at(self, rows: int) -> int:
        """The locality of a step of ``rows`` rows."""
        return self.few if rows < PREFETCH_MANY_FROM else self.many


@dataclass(frozen=True)
class PackRule:
    """Whether a projection runs its packed weight, per row bucket.

    Attributes:
        buckets: row counts, ascending.
        packed: per bucket, True where the packed weight runs (of the oneDNN and the model's own).
        source: where the rule came from: ``measured``, ``cached``, ``forced (TOKENROUTER_PACKING=...)``
            or ``default``.
        skinny: per bucket, True where the few-row kernel runs instead (empty: nowhere; a
            projection without its kernel weight runs ``packed``'s choice).

    ``rule(rows)`` says whether a step of ``rows`` tokens runs the packed weight; ``rule.path(rows)``
    which path runs: ``"skinny"``, ``"packed"`` or ``"plain"``.
    """

    buckets: tuple[int, ...]
    packed: tuple[bool, ...]
    source: str = "default"
    skinny: tuple[bool, ...] = ()

    def _index(self, rows: int) -> int:
        return min(bisect.bisect_left(self.buckets, rows), len(self.packed) - 1)

    def __call__(self, rows: int) -> bool:
        return self.packed[self._index(rows)]

    def path(self, rows: int) -> str:
        """``"skinny"``, ``"packed"`` or ``"plain"``: the path of a step of ``rows`` tokens."""
        i = self._index(rows)
        if self.skinny and self.skinny[i]:
            return "skinny"
        return "packed" if self.packed[i] else "plain"

    @classmethod
    def always(cls, packed: bool, source: str, skinny: bool = False) -> "PackRule":
        return cls(BUCKETS, (packed,) * len(BUCKETS), source, (skinny,) * len(BUCKETS) if skinny else ())

    def describe(self) -> str:
        """``skinny at 1-8 rows, packed at 16-64, plain at 128 rows`` style text."""
        runs: list[list] = []
        for b in self.buckets:
            p = self.path(b)
            if runs and runs[-1][0] == p:
                runs[-1][2] = b
            else:
                runs.append([p, b, b])
        parts = [f"{p} at {lo}{'' if lo == hi else f'-{hi}'}" for p, lo, hi in runs]
        return ", ".join(parts) + " rows"


def forced_path() -> str | None:
    """The path forced by ``TOKENROUTER_PACKING``: ``"packed"``, ``"plain"``, ``"skinny"``, or
    None (measure).

    Raises:
        ValueError: another value (names the accepted ones).
    """
    v = os.environ.get(PACKING_ENV, "auto").strip().lower() or "auto"
    if v not in PACKING_VALUES:
        raise ValueError(f"{PACKING_ENV}={v!r}: accepted values are {', '.join(PACKING_VALUES)}")
    return None if v == "auto" else v


def _cpu_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (``avx512f``, ...); empty where it
    cannot be read."""
    return set(_cpu_field("flags").split())


def last_level_cache_bytes() -> int:
    """The largest CPU cache of CPU 0 in bytes (Linux sysfs), or 32 MiB where it cannot be read."""
    best = 0
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in root.glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m:
            best = max(best, int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])
    return best or 32 << 20


def onednn_version() -> str:
    m = re.search(r"(?:oneDNN|MKL-DNN) v([\d.]+)", torch.__config__.show())
    return m.group(1) if m else ""


def machine_fields(threads: int | None = None) -> dict:
    """What a choice depends on besides the shapes: CPU model and flags (hashed), last-level
    cache bytes, torch threads, torch and oneDNN versions, the build of the engine's C++ kernels
    (their sources hashed: a changed kernel is measured again), the choices file format."""
    from .cpu_kernels import build_name

    flags = _cpu_field("flags")
    return {
        "cpu": _cpu_field("model name") or _cpu_field("vendor_id") or "unknown",
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "llc_bytes": last_level_cache_bytes(),
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        "torch": torch.__version__,
        "onednn": onednn_version(),
        "kernels": build_name(),
        "format": FORMAT,
    }


def choices_path(fields: dict) -> Path:
    """The choices file of the machine ``fields`` describe: ``<key>.json`` in the folder
    ``TOKENROUTER_CHOICES_DIR`` names, else in ``<torch extension root>/tokenrouter/choices``."""
    from .cpu_kernels import build_directory

    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]
    folder = os.environ.get(CHOICES_ENV, "").strip()
    return (Path(folder).expanduser() if folder else build_directory("choices")) / f"{key}.json"


@contextlib.contextmanager
def _locked(path: Path):
    """An OS lock on ``path``'s folder (one measurer per machine at a time; released when the
    process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "choices.flock", "w") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        yield


def load_choices(fields: dict) -> dict:
    """The stored choices for ``fields`` (empty when there is no file, it does not parse, or it
    was written for other fields)."""
    path = choices_path(fields)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("fields") != fields or not isinstance(data.get("choices"), dict):
        return {}
    return data["choices"]


def _store(fields: dict, key: str, entry: dict) -> None:
    path = choices_path(fields)
    choices = load_choices(fields)
    choices[key] = entry
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"fields": fields, "choices": choices}, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _rule_of(entry, skinny: bool = False) -> PackRule | None:
    """The rule an entry stores, or None when it is not one (or, with ``skinny``, when it was
    measured without the few-row kernel, which is there now)."""
    try:
        buckets, packed = tuple(int(b) for b in entry["buckets"]), tuple(bool(p) for p in entry["packed"])
        fast = tuple(bool(p) for p in entry.get("skinny", ()))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not buckets or len(buckets) != len(packed) or list(buckets) != sorted(set(buckets)):
        return None
    if fast and len(fast) != len(buckets) or (skinny and "skinny_ms" not in entry):
        return None
    return PackRule(buckets, packed, "cached", fast)


def group_key(proj) -> str:
    """The shape a choice is made for: ``packing float32 in=576 out=1728``."""
    w = proj.mods[0].weight
    return f"packing {str(w.dtype).removeprefix('torch.')} in={w.shape[1]} out={sum(proj.sizes)}"


def _median_s(fn: Callable[[], object], reps: int, clock=time.perf_counter) -> list[float]:
    out = []
    for _ in range(reps):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def _interleaved_ms(fns: list, reps: int, clock=time.perf_counter) -> list[float]:
    """The median ms of each of ``fns`` over ``reps`` timed calls, after one untimed call each;
    the calls interleaved, so that a drift of the machine hits every candidate alike."""
    for f in fns:
        f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for t, f in zip(times, fns):
            t += _median_s(f, 1, clock)
    return [1e3 * statistics.median(t) for t in times]


def measure_group(
    projs: list, *, buckets=BUCKETS, reps: int = REPS, llc_bytes: int | None = None, clock=time.perf_counter
) -> dict:
    """Time the packed and the plain path of a group of same-shape projections at each bucket.

    Args:
        projs: `Projection`s with a packed weight, all of one `group_key`; when every one also
            has its few-row kernel weight (``skinny``), that path is timed too.
        buckets: row counts to time.
        reps: timed passes per path and bucket (after one untimed pass each).
        llc_bytes: the last-level cache; passes cover weights of at least twice this (default
            `last_level_cache_bytes`).
        clock: seconds (``time.perf_counter``).

    Returns:
        ``{"buckets": [...], "packed": [bool...], "packed_ms": [...], "plain_ms": [...],
        "layers": n}``: medians in ms of one pass over ``n`` projections; with the few-row
        kernel also ``"skinny": [bool...]`` (its time by `kernel_ms_by_rows` within `skinny_edge`
        of the faster other) and ``"skinny_ms"`` (as measured).
    """
    w = projs[0].mods[0].weight
    per = sum(m.weight.numel() for m in projs[0].mods) * w.element_size()
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    n = min(len(projs), max(1, -(-2 * llc // max(1, per))))
    use = projs[:n]
    # the kernel's weights as they are now: a runner sharing these projections (a self-draft's
    # layers) may drop them meanwhile (`tune_packing`), and the timing goes on with these
    weights = [getattr(p, "skinny", None) for p in use]
    with_skinny = all(w is not None for w in weights)
    packed_ms, plain_ms, skinny_ms = [], [], []
    with torch.inference_mode():
        for rows in buckets:
            x = torch.randn(rows, w.shape[1], dtype=w.dtype)

            def packed():
                for p in use:
                    p.run_packed(x)

            def plain():
                for p in use:
                    p.run_plain(x)

            def skinny():
                for p, sw in zip(use, weights):
                    p.run_skinny(x, weight=sw)

            ms = _interleaved_ms([packed, plain] + ([skinny] if with_skinny else []), reps, clock)
            packed_ms.append(ms[0])
            plain_ms.append(ms[1])
            if with_skinny:
                skinny_ms.append(ms[2])
    out = {
        "buckets": list(buckets),
        "packed": [a < b for a, b in zip(packed_ms, plain_ms)],
        "packed_ms": [round(v, 4) for v in packed_ms],
        "plain_ms": [round(v, 4) for v in plain_ms],
        "layers": n,
    }
    if with_skinny:
        out["skinny"] = [
            s <= skinny_edge(min(a, b), n) for s, a, b in zip(kernel_ms_by_rows(skinny_ms), packed_ms, plain_ms)
        ]
        out["skinny_ms"] = [round(v, 4) for v in skinny_ms]
    return out


def forced_prefetch() -> int | None:
    """The few-row kernel's prefetch locality forced by ``TOKENROUTER_SKINNY_PREFETCH`` (0..3),
    or None (``auto`` or unset: measure).

    Raises:
        ValueError: another value (names the accepted ones).
    """
    v = os.environ.get(PREFETCH_ENV, "auto").strip().lower() or "auto"
    if v == "auto":
        return None
    if v not in ("0", "1", "2", "3"):
        raise ValueError(
            f"{PREFETCH_ENV}={v!r}: accepted values are auto, 0 (non-temporal), 1 (into L3), 2 (into L2), 3 (into L1)"
        )
    return int(v)


def measure_prefetch(
    projs: list,
    *,
    hints=PREFETCH_HINTS,
    rows=PREFETCH_ROWS,
    reps: int = PREFETCH_REPS,
    llc_bytes: int | None = None,
    clock=time.perf_counter,
) -> dict:
    """Time the few-row kernel with each prefetch locality over the projections' kernel weights.

    Args:
        projs: `Projection`s with their few-row kernel weight (``skinny``), in model order;
            passes take them in order until their weights reach four times the last-level cache
            (``llc_bytes``, default `last_level_cache_bytes`) and `PREFETCH_MIN_BYTES`, or all
            (a pass that fits a few caches measures a coin flip between the localities).
        hints: the localities to time (0..3).
        rows: row counts to time at (`PREFETCH_ROWS`: one for `Prefetch.few`, one for
            `Prefetch.many`).
        reps: timed passes per locality and row count (after one untimed pass each), interleaved.
        clock: seconds.

    Returns:
        ``{"hints": [...], "rows": [...], "ms": [[median ms of one pass per row count] per
        hint], "chosen": [h per row count], "layers": n}``: each row count's ``chosen`` is its
        fastest locality, or the row count's `PREFETCH_TIE` locality where that is within its margin
        (5%) of the fastest: a machine whose memory reads at two rates minutes apart measures
        a tie at its slow rate, and the tie takes, at each row count, the locality that is
        never far behind there.
    """
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    budget = max(4 * llc, PREFETCH_MIN_BYTES)
    use, total = [], 0
    for p in projs:
        w = getattr(p, "skinny", None)
        if w is None:
            continue
        use.append((p, w))
        total += w.numel() * w.element_size()
        if total >= budget:
            break
    ms = [[0.0] * len(rows) for _ in hints]
    with torch.inference_mode():
        for j, m in enumerate(rows):
            xs = {k: torch.randn(m, k) for k in {int(w.shape[1]) for _, w in use}}

            def pass_with(h):
                def f():
                    for p, w in use:
                        p.run_skinny(xs[int(w.shape[1])], weight=w, prefetch=h)

                return f

            for i, v in enumerate(_interleaved_ms([pass_with(h) for h in hints], reps, clock)):
                ms[i][j] = round(v, 4)
    ties, margin = PREFETCH_TIE
    tie_at, index = dict(zip(PREFETCH_ROWS, ties)), {h: i for i, h in enumerate(hints)}
    chosen = []
    for j, m in enumerate(rows):
        best = min(range(len(hints)), key=lambda i: ms[i][j])
        tie = index.get(tie_at.get(m))
        if tie is not None and ms[tie][j] <= (1 + margin) * ms[best][j]:
            best = tie
        chosen.append(int(hints[best]))
    return {"hints": list(hints), "rows": list(rows), "ms": ms, "chosen": chosen, "layers": len(use)}


def _prefetch_entry_valid(entry: dict) -> bool:
    hints, rows, ms, chosen = entry["hints"], entry["rows"], entry["ms"], entry["chosen"]
    return (
        list(hints) == list(PREFETCH_HINTS)
        and list(rows) == list(PREFETCH_ROWS)
        and isinstance(chosen, list)
        and len(chosen) == len(rows)
        and all(type(h) is int and h in hints for h in chosen)
        and len(ms) == len(hints)
        and all(len(r) == len(rows) for r in ms)
    )


def prefetch_key(projs: list) -> str:
    """The key of the stored prefetch choice for these projections: ``skinny prefetch float32 <n>
    projections <MB> MB`` (those with their few-row kernel weight)."""
    ws = [w for p in projs if (w := getattr(p, "skinny", None)) is not None]
    mb = sum(w.numel() * w.element_size() for w in ws) >> 20
    return f"{PREFETCH_KEY} {len(ws)} projections {mb} MB"


def tune_prefetch(projs: list, *, measure=measure_prefetch, fields: dict | None = None) -> tuple[Prefetch, str]:
    """Set ``prefetch`` (a `Prefetch`) on every projection of ``projs``: forced by
    ``TOKENROUTER_SKINNY_PREFETCH`` (one locality at every row count), else this machine's
    stored choice for projections of this count and size (`prefetch_key`), else measured
    (`measure_prefetch` over those of ``projs`` that have their few-row kernel weight) and stored.

    Returns:
        (the `Prefetch`, source): source is ``forced (...)``, ``cached``, ``measured`` or ``measured
        (not stored)``.

    Raises:
        ValueError: ``TOKENROUTER_SKINNY_PREFETCH`` holds an unknown value.
    """
    forced = forced_prefetch()
    if forced is not None:
        choice, source = Prefetch(forced, forced), f"forced ({PREFETCH_ENV}={forced})"
    else:
        entry, source = choose(prefetch_key(projs), lambda: measure(projs), _prefetch_entry_valid, fields=fields)
        choice = Prefetch(*entry["chosen"])
    for p in projs:
        p.prefetch = choice
    return choice, source


def describe_prefetch(key: str, entry) -> str | None:
    """The line `tokenrouter info` prints for a stored prefetch choice (None for other keys)."""
    if not key.startswith(PREFETCH_KEY + " ") or not isinstance(entry, dict):
        return None
    try:
        if not _prefetch_entry_valid(entry):
            return None
        times = "; ".join(
            f"{PREFETCH_NAMES.get(h, h)}: "
            + ", ".join(f"{r} row{'s' * (r > 1)} {v:.2f}" for r, v in zip(entry["rows"], ms))
            for h, ms in zip(entry["hints"], entry["ms"])
        )
        few, many = entry["chosen"]
        return (
            f"{key}: the few-row kernel prefetches {PREFETCH_NAMES[few]} at 1-{PREFETCH_MANY_FROM - 1} rows, "
            f"{PREFETCH_NAMES[many]} from {PREFETCH_MANY_FROM} (ms per pass over {entry.get('layers', '?')} "
            f"projections: {times})"
        )
    except (KeyError, TypeError, ValueError):
        return None


def tune_packing(
    projs: list, *, measure=measure_group, fields: dict | None = None, prefetch=measure_prefetch
) -> dict[str, PackRule]:
    """Set ``rule`` on every projection of ``projs`` that has a packed weight: forced by
    ``TOKENROUTER_PACKING``, else read from this machine's choices file, else measured
    (`measure_group`) and stored. Projections are grouped by `group_key`. When a group has its
    few-row kernel weights, the kernel's prefetch is chosen first (`tune_prefetch`, measured by
    ``prefetch``), and the kernel is timed with it.

    Returns:
        the rule per group key.

    Raises:
        ValueError: ``TOKENROUTER_PACKING`` or ``TOKENROUTER_SKINNY_PREFETCH`` holds an unknown value.
    """
    groups: dict[str, list] = {}
    for p in projs:
        if p.packed is not None:
            groups.setdefault(group_key(p), []).append(p)
    if not groups:
        return {}
    forced = forced_path()
    # whether every projection of a group has the kernel's weights as this call begins: a rule
    # made without them says nothing about the kernel
    fast = {k: all(getattr(p, "skinny", None) is not None for p in ps) for k, ps in groups.items()}
    if any(fast.values()):
        tune_prefetch([p for k, ps in groups.items() if fast[k] for p in ps], measure=prefetch, fields=fields)
    rules: dict[str, PackRule] = {}
    if forced is not None:
        rules = {
            k: PackRule.always(forced != "plain", f"forced ({PACKING_ENV}={forced})", forced == "skinny")
            for k in groups
        }
    else:
        fields = machine_fields() if fields is None else fields
        stored = load_choices(fields)
        missing = [k for k in groups if _rule_of(stored.get(k), fast[k]) is None]
        for k in groups:
            if k not in missing:
                rules[k] = _rule_of(stored[k], fast[k])
        if missing:
            try:
                with _locked(choices_path(fields)):
                    stored = load_choices(fields)  # another process may have measured meanwhile
                    for k in missing:
                        rule = _rule_of(stored.get(k), fast[k])
                        if rule is None:
                            entry = measure(groups[k])
                            entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                            rules[k] = PackRule(
                                tuple(entry["buckets"]),
                                tuple(entry["packed"]),
                                "measured",
                                tuple(entry.get("skinny", ())),
                            )
                            _store(fields, k, entry)
                        rules[k] = rule or rules[k]
            except OSError:  # the folder cannot be written: measure here, keep nothing
                for k in missing:
                    if k not in rules:
                        entry = measure(groups[k])
                        rules[k] = PackRule(
                            tuple(entry["buckets"]),
                            tuple(entry["packed"]),
                            "measured (not stored)",
                            tuple(entry.get("skinny", ())),
                        )
    for k, ps in groups.items():
        for p in ps:
            if not fast[k] and getattr(p, "skinny", None) is not None and any(p.rule.skinny):
                continue  # the weights and a rule with them came from a tune sharing p meanwhile
            if getattr(p, "released", False):
                continue  # its own weights are gone: it runs packed at every step size
            p.rule = rules[k]
            if fast[k] and getattr(p, "skinny", None) is not None and not any(rules[k].skinny):
                p.skinny = None  # never chosen: its copy of the weights goes
    return rules


def choose(
    key: str, measure: Callable[[], dict], valid: Callable[[dict], bool], *, fields: dict | None = None
) -> tuple[dict, str]:
    """One stored choice of this machine: the entry under ``key`` in its choices file when
    ``valid(entry)``, else ``measure()`` run under the file's lock (unless another process stored
    a valid one meanwhile), stamped with ``measured_at`` and stored.

    Returns:
        (entry, source): source is ``cached``, ``measured`` or ``measured (not stored)`` (the
        folder cannot be written).
    """
    fields = machine_fields() if fields is None else fields

    def stored() -> dict | None:
        entry = load_choices(fields).get(key)
        try:
            return entry if isinstance(entry, dict) and valid(entry) else None
        except (KeyError, TypeError, ValueError):
            return None

    entry = stored()
    if entry is not None:
        return entry, "cached"
    try:
        with _locked(choices_path(fields)):
            entry = stored()
            if entry is not None:
                return entry, "cached"
            entry = dict(measure(), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
            _store(fields, key, entry)
            return entry, "measured"
    except OSError:
        return dict(measure()), "measured (not stored)"


def report(fields: dict | None = None, describers: tuple = ()) -> list[str]:
    """Lines for `tokenrouter info`: where the choices live, and for each stored file of this
    CPU and these versions (one per thread count that measured), each choice and its timings.
    ``describers``: functions ``(key, entry) -> str | None`` for the choices other modules store
    (e.g. `tokenrouter_sdk.backends.attention.kernel_choice.describe`)."""
    fields = machine_fields() if fields is None else fields
    folder = choices_path(fields).parent
    lines = [
        f"measured choices: {folder} ({fields['cpu']}, last-level cache {fields['llc_bytes'] >> 20} MiB, "
        f"torch {fields['torch']}, oneDNN {fields['onednn'] or '?'})"
    ]
    forced = os.environ.get(PACKING_ENV)
    if forced:
        how = "measured choices apply" if forced == "auto" else "forced, the choices below do not apply"
        lines.append(f"  {PACKING_ENV}={forced} is set: {how}")
    same = {k: v for k, v in fields.items() if k != "threads"}
    found = 0
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            mine = {k: v for k, v in data["fields"].items() if k != "threads"} == same
            threads, choices = data["fields"]["threads"], dict(data["choices"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if not mine:
            continue
        for key, entry in sorted(choices.items()):
            rule = _rule_of(entry) if isinstance(entry, dict) else None
            if rule is None:
                text = next((t for t in (d(key, entry) for d in (describe_prefetch, *describers)) if t), None)
                if text:
                    found += 1
                    lines.append(f"  {threads} thread(s), {text}")
                continue
            found += 1
            sk = entry.get("skinny_ms") or []
            times = ", ".join(
                f"{b}: {a:.2f}/{c:.2f}" + (f"/{sk[i]:.2f}" if i < len(sk) else "")
                for i, (b, a, c) in enumerate(
                    zip(entry["buckets"], entry.get("packed_ms", []), entry.get("plain_ms", []))
                )
            )
            lines.append(
                f"  {threads} thread(s), {key}: {rule.describe()} (ms per pass over {entry.get('layers', '?')} "
                f"layers, packed/plain{'/skinny' if sk else ''} by rows: {times})"
            )
    if not found:
        lines.append("  none yet (measured at a float32/bfloat16 model's first step on this machine)")
    return lines
