"""CUDA-graph capture shared by the kernels' host loops (LoLA evictions, OVQ chunk runs).

A long prefill of these methods is a chain of small dependent launches whose arguments do not change from one
step to the next (the step index is read from a device counter). Issuing them from Python costs more than the
GPU work, so one step is captured once and replayed.
"""
from __future__ import annotations

import contextlib
import threading

import torch

# the side stream each thread captures on, per device: two threads capturing at once on one stream would record
# each other's work (a server's request threads sharing a patched model)
_CAPTURE_STREAMS = threading.local()
# whether this thread runs the CPU stand-in of a CUDA graph's capture or replay (`simulated_capture`)
_SIMULATED = threading.local()


@contextlib.contextmanager
def simulated_capture():
    """While the CPU stand-in of a CUDA graph (decode_graphs.py's simulated replay, the tests' `simulate`) records or
    replays a step in this thread, `capturing` says so: what a step skips under a real capture it skips then too."""
    was = getattr(_SIMULATED, "on", False)
    _SIMULATED.on = True
    try:
        yield
    finally:
        _SIMULATED.on = was


def capturing(device: torch.device) -> bool:
    """Whether the work now issued for `device` is being recorded into a CUDA graph (or its CPU stand-in in this
    thread: `simulated_capture`): host values read now would be baked into every replay, so code keeping a device
    copy of a host value in step skips refreshing it then (the recorded step must move the device copy itself)."""
    if getattr(_SIMULATED, "on", False):
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def capture_graph(fn, device: torch.device | int | None = None, pool=None):
    """Capture the GPU work of fn() in a CUDA graph; returns (graph, fn's result). Unlike the
    `torch.cuda.graph` context this does not synchronize the device, run `gc.collect()` or empty the
    allocator cache first: those cost a prefill about 0.3 ms of idle GPU per capture. The capture runs on a
    side stream that first waits for the current one; the current stream then waits for it. Allocations
    inside fn come from the graph's private pool, as with the context. ``device``: the CUDA device of the
    work (default: the current one). ``pool``: a `torch.cuda.graph_pool_handle()` shared with other graphs
    replayed one at a time (decode_graphs.py), else a private pool. Each thread captures on a side stream of its
    own, in the "thread_local" error mode: another thread's work meanwhile neither enters the graph nor fails
    because of it."""
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        dev = torch.cuda.current_device()
        streams = _CAPTURE_STREAMS.__dict__.setdefault("by_device", {})
        side = streams.get(dev)
        if side is None:
            side = streams[dev] = torch.cuda.Stream(dev)
        cur = torch.cuda.current_stream(dev)
        side.wait_stream(cur)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            g.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                g.capture_end()
        cur.wait_stream(side)
    return g, out


def run_steps(step, n: int, device: torch.device, *, graph: bool = True, eager_first: bool = True):
    """Run ``step()`` ``n`` times, in order. On CUDA (``graph``, ``n >= 3``, not inside a caller's own capture)
    one step is captured and replayed for the others; a step must then read which step it is from the device
    (a counter it advances), since every replay has the same arguments. ``eager_first``: run the first step
    eagerly before the capture (this compiles its kernels); once they are compiled the capture can come
    first, while the GPU still works on what was queued. If the capture fails, the steps run eagerly.
    Returns the graph, or None."""
    use = (graph and n >= 3 and torch.device(device).type == "cuda"
           and not torch.cuda.is_current_stream_capturing())
    done = 0
    if n > 0 and (eager_first or not use):
        step()
        done = 1
    g = None
    if use:
        try:
            g, _ = capture_graph(step, device)
        except Exception:  # noqa: BLE001 - the graph is an optimisation; run eagerly instead
            g = None
    for _ in range(n - done):
        if g is not None:
            g.replay()
        else:
            step()
    return g
