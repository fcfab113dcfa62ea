"""`muse`'s config: the far field and its options (docs/muse.md explains every option)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import ConfigError
from ...kernels.muse import BACKENDS, FAR_FIELDS, MuseOptions
from ..base import MethodConfig, option
from .guard import GUARD_ERROR, GUARD_ROWS


# defaults of the options whose best value depends on the far field (measured: docs/PERFORMANCE.md, "The cells far
# field", the speed / error trade-off at 64k)
FAR_FIELD_DEFAULTS = {
    "cells": dict(block_size=256, k_clusters=8, topk_blocks=10, peak_blocks=10),
    "tilted": dict(block_size=128, k_clusters=4, topk_blocks=4, peak_blocks=0),
}
FAR_FIELD_DEFAULTS["tilted-cells"] = FAR_FIELD_DEFAULTS["cells"]  # its exact part and cells are the cells plan's
Q_CLUSTERS = {"cells": 1, "tilted": 16, "tilted-cells": 256}  # q_clusters' default (the cells have no query clusters)

# min_seq_len's default on CUDA: the length from which each far field's defaults run faster than the exact attention
# they replace (SDPA: cuDNN on the H200), by head dim (a head dim between two entries takes the larger one's; above
# the last, the last's). Measured forward, plan included, bf16 (docs/PERFORMANCE.md "The cells far field", "MuSe at
# 16k", "The tilted-cells far field"; benchmarks/results/muse/cells-speed-*.json): the cells defaults run 0.91x cuDNN
# at 16k on Qwen2.5-Coder's 14 / 2 heads at D 64 and 32 / 8 heads at D 128 (1.16x at 32 / 8, D 64) and 1.8-2.1x at
# 32k; tilted-cells 0.50-0.56x at 16k and 1.01-1.08x at 32k. The per-block tilted design is slower than exact
# attention at every measured length (0.07x at 32k): it keeps the old default, 1024, as everywhere but CUDA.
CROSSOVER = {
    "cells": {64: 20480, 128: 24576},
    "tilted-cells": {64: 32768, 128: 32768},
}
MIN_SEQ_LEN = 1024  # min_seq_len's default off CUDA (and for far_field='tilted'): only the shortest prefills are exact


def crossover(far_field: str, head_dim: int) -> int | None:
    """CROSSOVER's length for `far_field` at `head_dim` (None: no crossover measured for the far field)."""
    table = CROSSOVER.get(far_field)
    if not table:
        return None
    dims = sorted(table)
    return table[next((d for d in dims if d >= head_dim), dims[-1])]


def parse_heads(value) -> list[int]:
    """exact_heads as given (a list of ints, or a string '0,3,5' / '0+3+5' / '' as --set and NAME(...) write it) ->
    the sorted distinct head indices; ConfigError otherwise."""
    if value is None:
        return []
    if isinstance(value, str):
        parts = [p for p in re.split(r"[,+\s]+", value.strip().strip("[]")) if p]
        try:
            value = [int(p) for p in parts]
        except ValueError:
            raise ConfigError(f"MuseConfig: exact_heads={value!r} is not a list of query head indices such as "
                              "'0,3' (or [0, 3])") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
        raise ConfigError(f"MuseConfig: exact_heads={value!r} is not a list of query head indices such as [0, 3]")
    if any(h < 0 for h in value):
        raise ConfigError(f"MuseConfig: exact_heads={list(value)} holds a negative index; query heads count from 0")
    return sorted(set(value))


@dataclass
class MuseConfig(MethodConfig):
    far_field: str = option("cells", "cells: each key cluster of an earlier block is one super-key shared by all "
                            "queries, linear in blocks (the fast path; q_clusters and topk_clusters unused); tilted: "
                            "one summary per (query cluster, cell) pair, quadratic in blocks (more accurate at 64k, "
                            "slower than exact attention); tilted-cells: the cells plan with each far cell summarised "
                            "per global query cluster, tilted at its centroid (more accurate than cells, slower)",
                            choices=list(FAR_FIELDS))
    block_size: int | None = option(None, "tokens per spatial block (exact causal attention inside a block); default "
                                    "256 (cells, tilted-cells) / 128 (tilted); Triton: a multiple of 128 (cells, "
                                    "tilted-cells), a power of two in 16..128 (tilted)", min=2)
    q_clusters: int | None = option(None, "query clusters per query head, the tilt centres of the summaries: per "
                                    "block (tilted, default 16) or over the whole sequence (tilted-cells, default "
                                    "256)", min=1)
    k_clusters: int | None = option(None, "key clusters (cells) per block and kv head, each one super-key; default "
                                    "8 (cells, tilted-cells) / 4 (tilted)", min=1)
    kmeans_iters: int = option(2, "Lloyd iterations of the clusterings (per block: farthest-point init; tilted-cells' "
                               "global query clusters: evenly spaced init)", min=0, max=50)
    topk_clusters: int = option(8, "tilted: earlier cells attended exactly per query cluster", min=0)
    topk_blocks: int | None = option(None, "earlier blocks attended exactly per query block (cells: those of most "
                                     "estimated attention mass) or per query cluster (tilted); default 10 (cells, "
                                     "tilted-cells) / 4 (tilted)", min=0)
    peak_blocks: int | None = option(None, "cells, tilted-cells: more earlier blocks attended exactly per query block, beyond "
                                     "topk_blocks: those whose best key scores highest at the block's mean query "
                                     "(max_j q.k_j), which finds a block whose one matching key a cell mean hides; "
                                     "default 10 (cells) / 0 (tilted has none)", min=0)
    local_blocks: int = option(1, "blocks just before a query's block that are always attended exactly", min=0)
    sink_blocks: int = option(1, "cells, tilted-cells: the first blocks with real tokens, attended exactly by every query block "
                              "(attention sinks: many heads put much of their weight on the first tokens)", min=0)
    dipole: bool = option(False, "tilted: first-order (dipole) correction of the super-keys' values; reference path "
                          "only")
    min_seq_len: int | None = option(None, "prefills shorter than this use exact attention (a row of a padded "
                                     "batch: its real tokens, as that prompt alone); default: on CUDA the measured "
                                     "length from which the far field's defaults beat exact attention (cells: 20k at "
                                     "head dim <= 64, 24k at 128; tilted-cells: 32k; CROSSOVER), elsewhere and for "
                                     "tilted 1024", min=0)
    exact_heads: list[int] = option([], "query heads (0-based) whose output is exact attention, over MuSe's: what a "
                                    "calibration sets for the few heads MuSe approximates worst (longctx calibrate; "
                                    "--set exact_heads=0,5)")
    exact_tail: int = option(128, "prefills that fill a KV cache in eval mode (generate): the last this-many "
                             "queries attend exactly to every key, recomputed after MuSe (the question at the end of "
                             "a prompt, and the positions the first generated token reads); 0: off. Training, "
                             "perplexity without a cache and the op-level kernel are unaffected", min=0)
    guard_error: float | None = option(GUARD_ERROR, "the run-time guard: every long prefill measures each head's "
                                       "error on guard_rows sampled query rows against exact attention (relative L2 "
                                       "over the rows MuSe approximates) and runs the heads above this budget "
                                       "exactly for that call; None or 0: off (docs/muse.md, 'The guard')", min=0.0)
    guard_rows: int = option(GUARD_ROWS, "query rows per batch row and head that the guard measures, stratified "
                             "over the approximated positions", min=1, max=4096)
    guard_kernels: bool = option(True, "the guard's estimate through its Triton kernels (6 launches where its "
                                 "PyTorch ops take ~65: 0.50 / 0.69 ms a layer against 1.58 / 1.81 at 32k / 64k on "
                                 "an H100, the same estimates; docs/muse.md, 'The estimate in three kernels'), where "
                                 "they run (Triton on the tensors; backend torch: never); false: the ops")
    backend: str = option("auto", "kernels: auto (Triton on CUDA when supported), triton, or torch (reference)",
                          choices=list(BACKENDS))

    def get(self, name: str) -> int:
        """The value of a far-field-dependent option: the one set, else FAR_FIELD_DEFAULTS[far_field]."""
        v = getattr(self, name)
        if v is None:
            return Q_CLUSTERS[self.far_field] if name == "q_clusters" else FAR_FIELD_DEFAULTS[self.far_field][name]
        return v

    def min_len(self, device_type: str, head_dim: int) -> int:
        """The shortest prefill that takes MuSe on a `device_type` device ("cuda", "cpu" ...) at `head_dim`:
        `min_seq_len` when set, else CROSSOVER's length for the far field on CUDA, else MIN_SEQ_LEN."""
        if self.min_seq_len is not None:
            return self.min_seq_len
        cut = crossover(self.far_field, head_dim) if device_type == "cuda" else None
        return MIN_SEQ_LEN if cut is None else cut

    def check(self) -> None:
        self.exact_heads = parse_heads(self.exact_heads)
        if self.guard_error is not None and not self.guard_error < 1:
            raise ConfigError(f"MuseConfig: guard_error={self.guard_error!r}: give the relative error a head's "
                              "attention output may have against exact attention before the guard makes it exact, a "
                              "number in [0, 1) (0.05 for 5%), or None / 0 to switch the guard off")
        L = self.get("block_size")
        if self.get("k_clusters") > L or (self.far_field == "tilted" and self.get("q_clusters") > L):
            raise ConfigError(
                f"MuseConfig: q_clusters ({self.get('q_clusters')}, tilted) and k_clusters ({self.get('k_clusters')}) must "
                f"be <= block_size ({L})"
            )
        if self.far_field == "tilted" and self.get("peak_blocks"):
            raise ConfigError("MuseConfig: peak_blocks needs far_field='cells' (tilted retrieves per query cluster)")
        if self.far_field != "tilted" and self.dipole:
            raise ConfigError("MuseConfig: dipole=True needs far_field='tilted' (the cells have no dipole term)")

    def kernel_options(self) -> MuseOptions:
        """What this config's MuSe computes (`kernels.muse.MuseOptions`, `muse_attention(..., options=)`; its backend
        is passed beside it)."""
        return MuseOptions(**{name: value for name, value in self.kernel_kwargs().items() if name != "backend"})

    def kernel_kwargs(self) -> dict:
        """The kernel options and the backend as one flat dict: a calibration's key of a setting (json), the settings
        `kernels.muse.attended_keys` counts from."""
        return dict(block_size=self.get("block_size"), q_clusters=self.get("q_clusters"),
                    k_clusters=self.get("k_clusters"),
                    kmeans_iters=self.kmeans_iters, topk_clusters=self.topk_clusters,
                    topk_blocks=self.get("topk_blocks"), peak_blocks=self.get("peak_blocks"),
                    local_blocks=self.local_blocks, sink_blocks=self.sink_blocks, dipole=self.dipole,
                    backend=self.backend, far_field=self.far_field)


__all__ = ["CROSSOVER", "FAR_FIELD_DEFAULTS", "MIN_SEQ_LEN", "MuseConfig", "Q_CLUSTERS", "crossover", "parse_heads"]
