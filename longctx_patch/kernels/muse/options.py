"""What MuSe computes, as one frozen object: `MuseOptions` (the far field, the blocks, the clusterings, what is
retrieved exactly), passed to `ops.muse_attention` as `options=`. The method's config (methods/muse/config.py
`MuseConfig.kernel_options()`) makes one from its settings; benchmarks and tests make their own. How the kernels run
(their launch tiles) is `support.MuseTiles`, passed beside it as `tiles=`. No Triton import."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...errors import ConfigError

FAR_FIELDS = ("cells", "tilted", "tilted-cells")  # muse_attention's far fields (docs/muse.md sections 1-4, 7, 8)


@dataclass(frozen=True)
class MuseOptions:
    """MuSe's options (docs/muse.md explains each; the defaults are the tilted far field's former ones, not the
    method's, which `MuseConfig` sets per far field).

    far_field: "tilted" (per query cluster and block), "cells" (kernels/muse/reference_cells.py: each key cluster of
    an earlier block is one super-key shared by every query; `topk_blocks` retrieved per query block by their
    estimated attention mass and `peak_blocks` more by their best key, plus the `sink_blocks` first blocks with a
    real key, exact for every query block; q_clusters, topk_clusters unused) or "tilted-cells"
    (kernels/muse/reference_tilted_cells.py: the cells plan, each far cell summarised for each of `q_clusters` global
    query clusters per head by its summary tilted at the cluster's centroid).
    block_size L: spatial block (exact attention inside it and over the `local_blocks` blocks before it);
    q_clusters / k_clusters: clusters per block of queries (per query head) and keys (per kv head);
    kmeans_iters: Lloyd iterations; topk_blocks / topk_clusters: earlier blocks / cells (key cluster of a block)
    attended exactly by each query cluster; dipole: first-order correction of the super-keys' values (tilted,
    reference only).

    Refused when built (ConfigError): an unknown far field, k_clusters (or, tilted, q_clusters) above block_size,
    peak_blocks with the tilted far field, dipole with another."""

    far_field: str = "tilted"
    block_size: int = 128
    q_clusters: int = 8
    k_clusters: int = 4
    kmeans_iters: int = 2
    topk_clusters: int = 4
    topk_blocks: int = 2
    peak_blocks: int = 0
    local_blocks: int = 1
    sink_blocks: int = 1
    dipole: bool = False

    def __post_init__(self):
        if self.far_field not in FAR_FIELDS:
            raise ConfigError(f"muse far_field={self.far_field!r}; allowed: {', '.join(FAR_FIELDS)}")
        if self.k_clusters > self.block_size or (self.far_field == "tilted" and self.q_clusters > self.block_size):
            raise ConfigError("muse: q_clusters and k_clusters must be <= block_size")
        if self.far_field == "tilted" and self.peak_blocks:
            raise ConfigError("muse: peak_blocks needs far_field='cells' (the tilted design retrieves per query "
                              "cluster)")
        if self.far_field != "tilted" and self.dipole:
            raise ConfigError("muse: dipole=True needs far_field='tilted'")

    def replace(self, **changes) -> "MuseOptions":
        """These options with `changes`; a ValueError names a key that is not an option."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"not MuSe options: {', '.join(unknown)}; the options: {', '.join(names)}")
        return dataclasses.replace(self, **changes)


DEFAULT_OPTIONS = MuseOptions()


def check_options(options) -> MuseOptions:
    """`options` as passed to an entry point: a MuseOptions (anything else: a ConfigError)."""
    if not isinstance(options, MuseOptions):
        raise ConfigError(f"muse: options must be a MuseOptions (kernels.muse.options), got {type(options).__name__}")
    return options


__all__ = ["DEFAULT_OPTIONS", "FAR_FIELDS", "MuseOptions", "check_options"]
