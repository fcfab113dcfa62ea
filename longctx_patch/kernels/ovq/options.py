"""How the OVQ Triton kernels run, never what they compute: `OvqKernelOptions`, one frozen object passed down from
`ops.ovq_attention` / `ops.ovq_open_attention` (`options=`) to the launches of `triton_fast.py`. Its defaults are what
the product runs; benchmarks and tests pass other values (benchmarks/ops/bench_ovq.py, bench_ovq_profile.py sweep
them) instead of changing anything inside the package. No Triton import: `ops.py` reads it on any install."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BLOCK_M = (64, 128)  # the query block's cap (`triton_fast._blk`: 16 / 32 below it for short chunks and decode)
BLOCK_N = (16, 32, 64, 128, 256)  # dictionary rows (and chunk keys) per tile


@dataclass(frozen=True)
class OvqKernelOptions:
    """The fused no-grad path's runs of chunks and the kernels' launch tiles (docs/ovq.md, "Kernels").

    graph_runs: a run of whole chunks is captured once in a CUDA graph and replayed (False: launched one by one,
    the same launches). mean_form: with bf16 assignment dots, a run reads row means kept beside the sums (False: the
    sums; the same rows, outputs equal up to rounding). block_m: the most queries (and keys of the assignment
    statistics) per program. block_n: dictionary rows per tile of the attention and the statistics. split_rows:
    dictionary rows per program of the attention and of the statistics (None: `triton_fast._rows_per_split`'s
    choice, 1024 / 512, 256 for a decode step)."""

    graph_runs: bool = True
    mean_form: bool = True
    block_m: int = 128
    block_n: int = 64
    split_rows: int | None = None

    def __post_init__(self):
        for name in ("graph_runs", "mean_form"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"OvqKernelOptions.{name}={getattr(self, name)!r}: allowed True or False")

        def whole(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not (whole(self.block_m) and self.block_m in BLOCK_M):
            raise ValueError(f"OvqKernelOptions.block_m={self.block_m!r}: allowed {' or '.join(map(str, BLOCK_M))}")
        if not (whole(self.block_n) and self.block_n in BLOCK_N):
            raise ValueError(f"OvqKernelOptions.block_n={self.block_n!r}: allowed one of "
                             f"{', '.join(map(str, BLOCK_N))}")
        if self.split_rows is not None and not (whole(self.split_rows) and self.split_rows >= 1):
            raise ValueError(f"OvqKernelOptions.split_rows={self.split_rows!r}: allowed None (the kernels' choice) or "
                             "a positive int")

    def replace(self, **changes) -> "OvqKernelOptions":
        """These options with `changes`; a ValueError names a key that is not an option."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"not OVQ kernel options: {', '.join(unknown)}; the options: {', '.join(names)}")
        return dataclasses.replace(self, **changes)


DEFAULT_OPTIONS = OvqKernelOptions()

__all__ = ["DEFAULT_OPTIONS", "OvqKernelOptions"]
