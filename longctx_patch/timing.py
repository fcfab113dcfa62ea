"""Where the time of a training step goes: `StepTimer` marks the end of each phase (forward, backward,
optimizer) with CUDA events on a GPU (no host wait inside the step) or the wall clock on a CPU. The speed eval marks
generate()'s steps with it too (`evals/speed_model.py`)."""

from __future__ import annotations

import statistics
import time

import torch


def cuda_median_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """The median time of `reps` calls of `fn` on the current CUDA stream, in milliseconds (CUDA events around each
    call, after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


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

    def span_ms(self, i: int, j: int) -> float:
        """Milliseconds from mark i to mark j (0: `start()`, then each `mark()` in order); waits for mark j on a GPU."""
        a, b = self._marks[i][1], self._marks[j][1]
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def finish(self) -> dict[str, float]:
        if len(self._marks) < 2:
            raise RuntimeError("StepTimer.finish needs start() and at least one mark()")
        out: dict[str, float] = {}
        for i, (name, _) in enumerate(self._marks[1:], 1):
            out[name] = out.get(name, 0.0) + self.span_ms(i - 1, i)
        out["total"] = self.span_ms(0, len(self._marks) - 1)
        self._marks = []
        return out


__all__ = ["StepTimer"]
