"""Where a result comes from: the commit of the code that produced it (results of `longctx eval`, fine-tune runs,
benchmark scripts). Imports nothing of the package: train/ and evals/ both take it from here."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path


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


__all__ = ["git_commit"]
