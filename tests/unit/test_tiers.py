"""The suite runs tier by tier, unit tests first, and prints the unit tier's one-line result as soon
as its last test ends (tests/tiers.py, registered by tests/conftest.py). Checked on a fake suite in
a temporary folder, run in a subprocess with a copy of the real tests/conftest.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers import TIERS, tier_of

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

TIER_TEST = """
import os

def _log(name):
    with open(os.environ["TIER_LOG"], "a") as f:
        f.write(name + "\\n")

def test_{tier}_first():
    _log("{tier}")
"""


@pytest.fixture
def fake_suite(tmp_path):
    suite = tmp_path / "suite"
    for tier in TIERS:  # alphabetical order would run browser, docs, integration, notebooks, unit
        (suite / tier).mkdir(parents=True)
        (suite / tier / f"test_{tier}.py").write_text(TIER_TEST.format(tier=tier))
    (suite / "unit" / "test_more_unit.py").write_text(
        TIER_TEST.format(tier="unit").replace("test_unit_first", "test_unit_second")
        + "\ndef test_unit_fails():\n    _log('unit')\n    assert 1 == 2\n"
        + "\nimport pytest\n\n@pytest.mark.skip(reason='shown as skipped')\ndef test_unit_skipped():\n    pass\n"
    )
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    return suite


def run(suite: Path, *args: str) -> tuple[str, list[str]]:
    log = suite.parent / f"order{len(list(suite.parent.glob('order*')))}.txt"
    env = dict(os.environ, TIER_LOG=str(log), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(suite.parent), *args],
        capture_output=True,
        text=True,
        cwd=suite.parent,
        env=env,
        timeout=240,
    )
    order = log.read_text().split() if log.exists() else []
    return proc.stdout + proc.stderr, order


def test_unit_tier_runs_first_and_reports_before_the_slow_tiers(fake_suite):
    out, order = run(fake_suite, "-q", str(fake_suite))  # the README's command is quiet
    assert order == ["unit"] * 3 + ["integration", "ray", "engines", "notebooks", "docs", "browser"], order
    m = re.search(r"^unit tier: 2 passed, 1 failed in \d+\.\d s, 1 skipped$", out, re.M)
    assert m, out
    # before the line: the four unit results (pass, fail, skip, pass), after it the other four tiers
    assert re.sub(r"\s|\[\s*\d+%\]", "", out[: m.start()]) == ".Fs.", out
    assert re.sub(r"\s|\[\s*\d+%\]", "", out[m.end() :]).startswith("...."), out


def test_no_line_without_unit_tests(fake_suite):
    out, order = run(fake_suite, "-q", str(fake_suite / "docs"), str(fake_suite / "browser"))
    assert order == ["docs", "browser"] and "unit tier:" not in out, out


def test_tier_of_paths():
    assert tier_of(TESTS / "unit" / "test_kv.py", TESTS) == "unit"
    assert tier_of(TESTS / "notebooks" / "test_tutorials.py", TESTS) == "notebooks"
    assert tier_of(TESTS / "helpers.py", TESTS) == "other" and tier_of(ROOT / "README.md", TESTS) == "other"
