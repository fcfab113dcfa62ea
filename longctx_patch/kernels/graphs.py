"""CUDA-graph capture shared by the kernels' host loops (LoLA evictions, OVQ chunk runs).

A long prefill of these methods is a chain of small dependent launches whose arguments do not change from one
step to the next (the step index is read from a device counter). Issuing them from Python costs more than the
GPU work, so one step is captured once and replayed.
"""
from __future__ import annotations

import torch

_CAPTURE_STREAMS: dict = {}


def capture_graph(fn, device: torch.device | int | None = None):
    """Capture the GPU work of fn() in a CUDA graph; returns (graph, fn's result). Unlike the
    `torch.cuda.graph` context this does not synchronize the device, run `gc.collect()` or empty the
    allocator cache first: those cost a prefill about 0.3 ms of idle GPU per capture. The capture runs on a
    side stream that first waits for the current one; the current stream then waits for it. Allocations
    inside fn come from the graph's private pool, as with the context. ``device``: the CUDA device of the
    work (default: the current one)."""
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        dev = torch.cuda.current_device()
        side = _CAPTURE_STREAMS.get(dev)
        if side is None:
            side = _CAPTURE_STREAMS[dev] = torch.cuda.Stream(dev)
        cur = torch.cuda.current_stream(dev)
        side.wait_stream(cur)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            g.capture_begin()
            try:
                out = fn()
            finally:
                g.capture_end()
        cur.wait_stream(side)
    return g, out
