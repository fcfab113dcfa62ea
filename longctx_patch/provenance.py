"""Where a result comes from, in one spelling for every result file (results of `longctx eval`, fine-tune runs, the
benchmark scripts): the device it was measured on (`device_description`), when (`utc_now`), the commit of the code
(`git_commit`) and the command that produced it (`command_line`); `result_header` gives the four together. Imports
nothing of the package: train/, evals/ and the scripts all take them from here."""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

# The one spelling of a result's `device`: a GPU's name as its driver reports it ("NVIDIA H200"), or "CPU" with what is
# known of it in parentheses ("CPU (x86_64, 2 cores, 2 threads)": the architecture, the cores, torch's threads), in
# front "N x " when N processes of one run each had one (tests/test_results_index.py holds every result to it)
DEVICE_SPELLING = re.compile(r"(?:[1-9]\d* x )?(?:CPU(?: \([^()]+\))?|(?!(?i:cpu|cuda))[A-Za-z][^:;()]*[^:;() ])")


@functools.lru_cache(maxsize=None)
def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """$LONGCTX_COMMIT when set (copies of the tree on another machine, whose .git may be missing or stale),
    else `git rev-parse --short HEAD` in `cwd` (default: this package's folder), else "unknown"."""
    if os.environ.get("LONGCTX_COMMIT"):
        return os.environ["LONGCTX_COMMIT"]
    cwd = cwd if cwd is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_description(device=None, world: int = 1) -> str:
    """The device of a result in the one spelling (DEVICE_SPELLING): a CUDA device's name ("NVIDIA H200"), else
    "CPU (x86_64, 2 cores, 2 threads)" (torch's threads); "2 x ..." for a run of `world` processes. `device`: a
    torch.device or its name; None: the current CUDA device when there is one, else the CPU."""
    import torch

    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        idx = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
        one = torch.cuda.get_device_name(idx)
    else:
        threads = torch.get_num_threads()
        one = (f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {threads} "
               f"thread{'s' if threads != 1 else ''})")
    return f"{world} x {one}" if world > 1 else one


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that runs this process, as one shell line: `argv` (default sys.argv) with its program's folder
    dropped; a program run as `python -m MODULE` (the benchmarks, `accelerate launch -m ...`) as that."""
    if argv is None:
        orig = list(getattr(sys, "orig_argv", None) or [])
        i = 1
        while i < len(orig) and orig[i].startswith("-") and orig[i] != "-m":
            i += 1  # the interpreter's own options (-u, -X ...)
        if i + 1 < len(orig) and orig[i] == "-m":
            return shlex.join([os.path.basename(orig[0]), *orig[i:]])
        argv = sys.argv
    argv = list(argv)
    if argv:
        argv[0] = os.path.basename(argv[0])
    return shlex.join(argv)


def utc_now() -> str:
    """Now, as results record their date: UTC to the second, e.g. 2026-12-03T14:05:09Z."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def result_header(*, device=None, world: int = 1, command: str | None = None) -> dict[str, str]:
    """The fields every result file starts with: device (`device_description(device, world)`), date (`utc_now`),
    commit (`git_commit`) and command (`command` as given, else `command_line()`)."""
    return {"device": device_description(device, world), "date": utc_now(), "commit": git_commit(),
            "command": command if command is not None else command_line()}


__all__ = ["DEVICE_SPELLING", "command_line", "device_description", "git_commit", "result_header", "utc_now"]
