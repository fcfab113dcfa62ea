"""`muse`'s config: the far field and its options (docs/muse.md explains every option)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...kernels.muse import BACKENDS, FAR_FIELDS
from ..base import MethodConfig, option


# defaults of the options whose best value depends on the far field (measured: docs/PERFORMANCE.md, "The cells far
# field", the speed / error trade-off at 64k)
FAR_FIELD_DEFAULTS = {
    "cells": dict(block_size=256, k_clusters=8, topk_blocks=10, peak_blocks=10),
    "tilted": dict(block_size=128, k_clusters=4, topk_blocks=4, peak_blocks=0),
}
FAR_FIELD_DEFAULTS["tilted-cells"] = FAR_FIELD_DEFAULTS["cells"]  # its exact part and cells are the cells plan's
Q_CLUSTERS = {"cells": 1, "tilted": 16, "tilted-cells": 256}  # q_clusters' default (the cells have no query clusters)


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
    min_seq_len: int = option(1024, "prefills shorter than this use exact attention (a row of a padded batch: "
                              "its real tokens, as that prompt alone)", min=0)
    exact_tail: int = option(128, "prefills that fill a KV cache in eval mode (generate): the last this-many "
                             "queries attend exactly to every key, recomputed after MuSe (the question at the end of "
                             "a prompt, and the positions the first generated token reads); 0: off. Training, "
                             "perplexity without a cache and the op-level kernel are unaffected", min=0)
    backend: str = option("auto", "kernels: auto (Triton on CUDA when supported), triton, or torch (reference)",
                          choices=list(BACKENDS))

    def get(self, name: str) -> int:
        """The value of a far-field-dependent option: the one set, else FAR_FIELD_DEFAULTS[far_field]."""
        v = getattr(self, name)
        if v is None:
            return Q_CLUSTERS[self.far_field] if name == "q_clusters" else FAR_FIELD_DEFAULTS[self.far_field][name]
        return v

    def check(self) -> None:
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

    def kernel_kwargs(self) -> dict:
        return dict(block_size=self.get("block_size"), q_clusters=self.get("q_clusters"),
                    k_clusters=self.get("k_clusters"),
                    kmeans_iters=self.kmeans_iters, topk_clusters=self.topk_clusters,
                    topk_blocks=self.get("topk_blocks"), peak_blocks=self.get("peak_blocks"),
                    local_blocks=self.local_blocks, sink_blocks=self.sink_blocks, dipole=self.dipole,
                    backend=self.backend, far_field=self.far_field)


__all__ = ["FAR_FIELD_DEFAULTS", "MuseConfig", "Q_CLUSTERS"]
