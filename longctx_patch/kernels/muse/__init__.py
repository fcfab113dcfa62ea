"""MuSe (multipole semantic attention) kernels: `ops` (the dispatch `muse_attention` and the Triton paths'
`autograd.Function`s), `options` (`MuseOptions`: what MuSe computes, passed as `options=`), `plan` (the clustering
and retrieval plan of the tilted far field), `reference` / `reference_cells` / `reference_tilted_cells` (PyTorch: each
far field's reference, the cells' plans with theirs), `support` (which inputs the kernels take; `MuseTiles`, their
launch tiles passed as `tiles=`), `triton_planned` / `triton_cells` / `triton_tilted` / `triton_tilted_bwd` /
`triton_cluster` (the kernels).

`muse_attention(q, k, v, scale=..., options=MuseOptions(...))` is the entry point (see its docstring); docs/muse.md
has the maths.
"""

from ..backend import BACKENDS  # noqa: F401  (the methods' `backend` option lists them)
from .ops import listed_blocks_triton, muse_attention
from .options import FAR_FIELDS, MuseOptions
from .plan import MusePlan, attended_keys, lloyd, make_plan
from .reference import muse_reference_planned
from .support import MuseTiles, cells_supported, triton_supported

__all__ = ["attended_keys", "cells_supported", "FAR_FIELDS", "MuseOptions", "MusePlan", "MuseTiles",
           "listed_blocks_triton", "make_plan", "lloyd", "muse_attention", "muse_reference_planned", "triton_supported"]
