"""The sm_90 compile of tests/test_kernels_compile.py (tests/compile_sm90.py, minutes of CPU) in the background.

It is started as soon as the tests are collected, when the selection holds a test of test_kernels_compile.py (by
the only process, or under pytest-xdist by worker gw0), and runs beside the other tests; those tests come last
(tests/conftest.py) and read its result. Every process of a run shares one folder for it: the first process
(the xdist controller) makes it and names it in $LONGCTX_TEST_SHARED, which the workers inherit. Whoever calls
`start` first starts the compile (an exclusive marker file), so it runs once per test run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED_ENV = "LONGCTX_TEST_SHARED"
SCRIPT = Path(__file__).with_name("compile_sm90.py")
MODULE = "test_kernels_compile.py"


def _shared() -> Path:
    d = os.environ.get(SHARED_ENV)
    if not d:  # a process that is not under this suite's conftest (none should be)
        d = tempfile.mkdtemp(prefix="longctx-tests-")
        os.environ[SHARED_ENV] = d
    return Path(d)


def start(jobs: int | None = None) -> None:
    """Start the compile in the background unless a process of this run already did."""
    d = _shared()
    try:
        fd = os.open(d / "compile.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    if jobs is None:  # two processes where there are two CPUs: the compile is the run's longest single step
        from conftest import available_cpus

        jobs = min(2, available_cpus())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    # the script's output goes to files; rc is written last (its presence says the compile has ended)
    wrapper = (
        "import subprocess, sys, os\n"
        f"out, err = open({str(d / 'compile.json')!r}, 'w'), open({str(d / 'compile.err')!r}, 'w')\n"
        f"rc = subprocess.call([sys.executable, {str(SCRIPT)!r}, '--jobs', '{jobs}'], stdout=out, stderr=err)\n"
        f"open({str(d / 'compile.rc.tmp')!r}, 'w').write(str(rc))\n"
        f"os.replace({str(d / 'compile.rc.tmp')!r}, {str(d / 'compile.rc')!r})\n"
    )
    # started through a launcher that exits at once, so that the compile is no child of this process: its CPU time
    # would otherwise count, once reaped, in the time budget of whichever test reaps it (tests/time_budget.py)
    launcher = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {wrapper!r}], stdin=subprocess.DEVNULL, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)\n"
        f"open({str(d / 'compile.pid')!r}, 'w').write(str(p.pid))\n"
    )
    subprocess.run([sys.executable, "-c", launcher], env=env, stdin=subprocess.DEVNULL, check=True)


def result(timeout: float = 1800.0) -> dict:
    """The compile's JSON (started here if no process has started it), waiting for it to end."""
    start()
    d = _shared()
    rc_file = d / "compile.rc"
    deadline = time.monotonic() + timeout
    while not rc_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sm_90 compile ({SCRIPT.name}) did not end within {timeout:g} s")
        time.sleep(0.5)
    rc = int(rc_file.read_text())
    if rc != 0:
        raise RuntimeError(f"{SCRIPT.name} exited with {rc}: {(d / 'compile.err').read_text()[-3000:]}")
    return json.loads((d / "compile.json").read_text().strip().splitlines()[-1])


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config) -> None:
    if not _is_worker(config) and not os.environ.get(SHARED_ENV):
        d = tempfile.mkdtemp(prefix="longctx-tests-")
        os.environ[SHARED_ENV] = d  # inherited by the xdist workers, started after this
        config._longctx_shared = d


def pytest_collection_finish(session) -> None:
    config = session.config
    if _is_worker(config) and config.workerinput.get("workerid") != "gw0":
        return
    if any(item.path.name == MODULE for item in session.items):
        start()


def pytest_unconfigure(config) -> None:
    d = getattr(config, "_longctx_shared", None)
    if d is None:
        return
    pid = Path(d, "compile.pid")
    if pid.exists() and not Path(d, "compile.rc").exists():  # the run ended first (interrupted, -x): stop it
        import signal

        try:
            os.killpg(int(pid.read_text()), signal.SIGTERM)
        except (ProcessLookupError, PermissionError, ValueError):
            pass
    os.environ.pop(SHARED_ENV, None)
    shutil.rmtree(d, ignore_errors=True)
