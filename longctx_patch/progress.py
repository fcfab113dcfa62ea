"""Progress of long steps on stderr: a tqdm bar on a terminal, plain lines otherwise.

A bar redrawn with carriage returns is one unreadable line in a log file, a CI log or a notebook's captured
stderr; there a line `DESC: DONE/TOTAL UNIT (ELAPSED s, ~LEFT s left)` is printed when the step starts, at most
every `LINE_SECONDS` while it runs, and when it ends.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

LINE_SECONDS = 10.0  # without a terminal: at most one progress line this often (and one at the start and the end)


def stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """Counts `total` units of a step: `update(n)` as they are done, `close()` at the end (or use it as a
    context manager). On a terminal a tqdm bar; otherwise plain lines (see the module's docstring); with
    `enabled=False` nothing. `every`: seconds between lines without a terminal."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True, every: float = LINE_SECONDS,
                 terminal: bool | None = None):
        self.total, self.desc, self.unit, self.every = int(total), desc, unit, float(every)
        self.n = 0
        self.enabled = enabled
        self.closed = False
        self._bar = None
        self._postfix = ""
        self._start = time.perf_counter()
        self._last_line = self._start
        if not enabled:
            return
        if stderr_is_terminal() if terminal is None else terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=sys.stderr, leave=False, mininterval=0)
        else:
            self._line()

    def _line(self) -> None:
        elapsed = time.perf_counter() - self._start
        text = f"{self.desc}: {self.n}/{self.total} {self.unit} ({elapsed:.0f} s"
        if 0 < self.n < self.total:
            text += f", ~{elapsed * (self.total - self.n) / self.n:.0f} s left"
        print(text + ")" + self._postfix, file=sys.stderr, flush=True)
        self._last_line = time.perf_counter()

    def update(self, n: int = 1) -> None:
        if not self.enabled or self.closed:
            return
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.n >= self.total or time.perf_counter() - self._last_line >= self.every:
            self._line()
            if self.n >= self.total:
                self.closed = True  # the end's line is printed: close() adds none

    def set_postfix(self, **values) -> None:
        """Figures shown after the count (e.g. loss=...), as tqdm's set_postfix."""
        if self._bar is not None:
            self._bar.set_postfix(**values)
        self._postfix = "".join(f", {k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.enabled or self.closed:
            return
        self.closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            self._line()  # where a step stopped early (an error, an interruption) the last line says how far it got

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_iter(items: Iterable[T], desc: str, enabled: bool = True, unit: str = "it",
                  every: float = LINE_SECONDS) -> Iterator[T]:
    """`items` one by one, their progress shown as `Progress` shows it (len(items) is the total)."""
    items = list(items)
    with Progress(len(items), desc, unit=unit, enabled=enabled, every=every) as bar:
        for x in items:
            yield x
            bar.update(1)
