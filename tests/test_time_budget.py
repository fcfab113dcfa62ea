"""The per-test time budget (tests/time_budget.py): a test whose call computes past it (itself or in a subprocess)
fails, one marked with a larger budget and a reason passes, waiting does not count, and a mark without a reason is
refused before anything runs."""

import os
from pathlib import Path

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

BODY = r"""
import time
import pytest

def test_quick():
    pass

def busy(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_slow():
    busy(0.6)

@pytest.mark.budget(240, reason="computes on purpose")
def test_slow_but_marked():
    busy(0.6)

def test_waiting_is_not_computing():
    time.sleep(0.6)

def test_a_subprocess_counts():
    import subprocess, sys
    code = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", code], check=True)
"""


def _run(pytester, monkeypatch, body):
    """`body` as a test file, run in a subprocess with the budget plugin and a budget of 0.3 s (1/200 of the
    default 60 s: a budget mark's seconds are scaled alike, 240 -> 1.2 s)."""
    pytester.makepyfile(test_timed=body)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("LONGCTX_TEST_BUDGET", "0.3")
    return pytester.runpytest_subprocess("-p", "time_budget", "-p", "no:cacheprovider", "-p", "no:xdist", "-q")


def test_a_test_past_its_budget_fails(pytester, monkeypatch):
    r = _run(pytester, monkeypatch, BODY)
    r.assert_outcomes(passed=3, failed=2)
    out = r.stdout.str()
    assert "FAILED test_timed.py::test_slow - " in out and "FAILED test_timed.py::test_a_subprocess_counts" in out
    assert "s of CPU" in out and "past its time budget of 0.3 s" in out


def test_a_budget_mark_needs_a_reason(pytester, monkeypatch):
    r = _run(pytester, monkeypatch, "import pytest\n\n@pytest.mark.budget(120)\ndef test_x():\n    pass\n")
    assert r.ret != 0 and "takes the seconds and a reason" in r.stderr.str() + r.stdout.str()
