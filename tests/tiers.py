"""Run the suite tier by tier, fastest first, and report the unit tier as soon as it ends.

Tiers are the folders under tests/: ``unit`` (tiny models, seconds each), then ``integration``
(the real SmolLM2 pair), ``ray`` (a simulated Ray cluster; skipped without Ray), ``engines``
(models run by vLLM's runner; skipped without the ``vllm`` extra), ``notebooks``,
``docs`` and ``browser``. `TierReport` sorts the collected
items by tier (stable: the order inside a tier is unchanged) and, when the last unit item
finishes, prints one line, e.g. ``unit tier: 412 passed, 0 failed in 95.2 s``, before the slow
tiers start. A run without unit items prints nothing. tests/conftest.py registers it in ``pytest_configure``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "ray", "engines", "notebooks", "docs", "browser")


def tier_of(path: Path, root: Path) -> str:
    """The tier of a test file: the first folder of its path under ``root`` (tests/), or
    ``"other"`` (after every tier) for files outside the tier folders."""
    try:
        first = Path(path).resolve().relative_to(root).parts[0]
    except (ValueError, IndexError):
        return "other"
    return first if first in TIERS else "other"


def tier_rank(tier: str) -> int:
    return TIERS.index(tier) if tier in TIERS else len(TIERS)


class TierReport:
    """Pytest plugin: order by tier, count the unit tier's outcomes, print its line when it ends.

    Args:
        config: the pytest config (its terminal reporter prints the line).
        root: the tests/ folder whose sub-folders are the tiers.
    """

    def __init__(self, config, root: Path):
        self.config = config
        self.root = Path(root).resolve()
        self.unit_ids: set[str] = set()
        self.last_unit: str | None = None
        self.t0: float | None = None
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
        self.line: str | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items) -> None:
        items.sort(key=lambda it: tier_rank(tier_of(it.path, self.root)))

    def pytest_collection_finish(self, session) -> None:
        unit = [it.nodeid for it in session.items if tier_of(it.path, self.root) == "unit"]
        self.unit_ids, self.last_unit = set(unit), (unit[-1] if unit else None)

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        if self.t0 is None and nodeid in self.unit_ids:
            self.t0 = time.perf_counter()

    def pytest_runtest_logreport(self, report) -> None:
        if report.nodeid not in self.unit_ids:
            return
        if report.when == "call":
            key = "passed" if report.passed else "failed" if report.failed else "skipped"
            self.counts[key] += 1
        elif report.skipped:  # skipped in setup (skip marks, skipif)
            self.counts["skipped"] += 1
        elif report.failed:  # a fixture failed in setup or teardown
            self.counts["errors"] += 1

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        if nodeid != self.last_unit or self.line is not None:
            return
        c = self.counts
        self.line = (
            f"unit tier: {c['passed']} passed, {c['failed']} failed in "
            f"{time.perf_counter() - (self.t0 or time.perf_counter()):.1f} s"
        )
        self.line += "".join(f", {c[k]} {k}" for k in ("skipped", "errors") if c[k])
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.ensure_newline()  # after a verbose line
            if getattr(tr, "_width_of_current_line", 0):  # after a line of progress letters (-q)
                tr.write("\n")
            tr.write_line(self.line, bold=True, red=bool(c["failed"] or c["errors"]))
        else:
            print(self.line, flush=True)
