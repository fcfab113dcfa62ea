"""Where the time of a training step goes: `StepTimer` marks the end of each phase (forward, backward,
optimizer) with CUDA events on a GPU (no host wait inside the step) or the wall clock on a CPU."""

from __future__ import annotations

import time

import torch


class StepTimer:
    """`start()`, then `mark(phase)` at the end of each phase of the step (a phase may recur: gradient
    accumulation), then `finish()` -> milliseconds per phase, summed, and "total"."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        if not self._marks:
            raise RuntimeError("StepTimer.mark before start()")
        self._marks.append((phase, self._now()))

    def finish(self) -> dict[str, float]:
        if len(self._marks) < 2:
            raise RuntimeError("StepTimer.finish needs start() and at least one mark()")
        if self.cuda:
            self._marks[-1][1].synchronize()
            span = lambda a, b: a.elapsed_time(b)  # noqa: E731
        else:
            span = lambda a, b: (b - a) * 1e3  # noqa: E731
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            out[name] = out.get(name, 0.0) + span(a, b)
        out["total"] = span(self._marks[0][1], self._marks[-1][1])
        self._marks = []
        return out


__all__ = ["StepTimer"]
