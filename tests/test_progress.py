"""Progress of long steps: a bar on a terminal, plain lines without one (a log file, CI, a notebook)."""

import io
import sys

from longctx_patch.progress import Progress, progress_iter


def test_lines_without_a_terminal(capsys):
    """Without a terminal: a line at the start, at the end, and in between at most every `every` seconds, each
    ending in a newline (no carriage-return redraws)."""
    for _ in progress_iter(range(4), "step", unit="items", every=3600):
        pass
    err = capsys.readouterr().err
    assert err.splitlines() == ["step: 0/4 items (0 s)", "step: 4/4 items (0 s)"] and "\r" not in err
    for _ in progress_iter(range(3), "step", every=0):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["step: 0/3 it", "step: 1/3 it", "step: 2/3 it", "step: 3/3 it"]
    assert "s left)" in lines[1]


def test_stopped_early_says_how_far_and_postfix(capsys):
    with Progress(10, "train", unit="steps", every=3600) as bar:
        bar.update(3)
        bar.set_postfix(loss="1.25")
    assert capsys.readouterr().err.splitlines()[-1].startswith("train: 3/10 steps (0 s, ~0 s left), loss=1.25")
    for _ in progress_iter(range(3), "off", enabled=False):
        pass
    assert capsys.readouterr().err == ""


def test_bar_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    for _ in progress_iter(range(3), "bar"):
        pass
    assert "\r" in err.getvalue() and "3/3" in err.getvalue()


def test_a_closed_stderr_is_not_a_terminal(monkeypatch):
    from longctx_patch.progress import stderr_is_terminal

    s = io.StringIO()
    s.close()
    monkeypatch.setattr(sys, "stderr", s)
    assert stderr_is_terminal() is False
