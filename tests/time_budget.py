"""A time budget per test: a test whose call takes more than BUDGET_S seconds of CPU fails, unless it is marked
`@pytest.mark.budget(SECONDS, reason="why it needs that long")` (a larger budget, with its justification).

So that the suite stays within the README's time on a 2-core CPU, a test that grows past the budget is noticed
when it grows, not when the whole suite is found slow. The budget is on the test's own call (setup and teardown,
where shared fixtures such as the session's model load are built, are left out: --durations shows them), in CPU
seconds: the test process's (all its threads) and those of the subprocesses it waited for. CPU time, not wall time,
so that a loaded machine (other jobs, the other pytest-xdist workers, the sm_90 compile beside them) does not fail
a test that did not grow; with one torch thread per worker (tests/conftest.py) it is the wall time of an idle core.
The budget is set with LONGCTX_TEST_BUDGET (seconds; e.g. on a slower machine), 60 by default. Loaded by
tests/conftest.py.
"""

from __future__ import annotations

import os
import time

try:
    import resource
except ImportError:  # pragma: no cover - Windows: the process's own CPU time only
    resource = None

import pytest

BUDGET_S = 60.0
ENV = "LONGCTX_TEST_BUDGET"


def budget_s() -> float:
    return float(os.environ.get(ENV) or BUDGET_S)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"budget(seconds, reason): this test may run up to `seconds` (instead of ${ENV}, default {BUDGET_S:g} s); "
        "the reason, required, says why it needs that long",
    )


def _marked(item) -> float | None:
    """The seconds of the test's budget mark (None without one); a mark without seconds or a reason is refused."""
    mark = item.get_closest_marker("budget")
    if mark is None:
        return None
    seconds = mark.args[0] if mark.args else mark.kwargs.get("seconds")
    reason = mark.kwargs.get("reason") or (mark.args[1] if len(mark.args) > 1 else None)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0 \
            or not (isinstance(reason, str) and reason.strip()):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.budget takes the seconds and a reason, e.g. "
                                f"@pytest.mark.budget(120, reason='...'); got args {mark.args}, kwargs {mark.kwargs}")
    return float(seconds)


def pytest_collection_modifyitems(items) -> None:
    for item in items:  # every mark checked before anything runs
        _marked(item)


def _allowed(item) -> float:
    marked = _marked(item)
    if marked is None:
        return budget_s()
    return marked * budget_s() / BUDGET_S  # a larger $LONGCTX_TEST_BUDGET scales the marked budgets too


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its subprocesses that have ended."""
    t = time.process_time()
    if resource is not None:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        t += kids.ru_utime + kids.ru_stime
    return t


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    allowed = _allowed(item)
    cpu, wall = cpu_seconds(), time.perf_counter()
    result = yield
    cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    if cpu > allowed:
        pytest.fail(f"{item.nodeid} took {cpu:.1f} s of CPU ({wall:.1f} s wall), past its time budget of {allowed:g} s "
                    "(tests/time_budget.py): make it smaller, or mark it @pytest.mark.budget(SECONDS, reason=...) "
                    "saying why it needs that long", pytrace=False)
    return result
