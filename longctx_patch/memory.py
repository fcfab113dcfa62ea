"""What memory a device has left: `available_memory`, read by patch() (a method's decode state must fit before any
cache allocates it: methods.base.Method.check_state_memory) and by the fine-tune's plan (train/plan.py)."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def available_memory(device: torch.device | str) -> int | None:
    """Bytes a run may still take: free memory of a CUDA device (what the driver has free, plus what PyTorch's caching
    allocator holds unused), else the host's available memory (MemAvailable), capped by this process's cgroup limit
    where one is set; None where neither can be read (or for another device, e.g. `meta`)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(torch.cuda.mem_get_info(dev)[0]) + max(0, int(cached))
    if dev.type != "cpu":
        return None
    avail = None
    try:
        m = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        avail = int(m.group(1)) * 1024 if m else None
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                free = int(limit) - int(Path(usage_file).read_text().strip())
                avail = free if avail is None else min(avail, free)
            break
        except (OSError, ValueError):
            continue
    return avail


def gib(n: int) -> str:
    """`n` bytes as GiB, for messages ('3.2 GiB'; small sizes in MiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


__all__ = ["available_memory", "gib"]
