"""MuSe (multipole semantic attention) kernels: `ops` (the dispatch `muse_attention` and the Triton paths'
`autograd.Function`s), `plan` / `cells` (the clustering and retrieval plans), `reference` / `cells` (PyTorch),
`support` (which inputs the kernels take), `triton_planned` / `triton_cells` / `triton_cluster` (the kernels).

`muse_attention(q, k, v, ...)` is the entry point (see its docstring); docs/muse.md has the maths.
"""

from ..backend import BACKENDS  # noqa: F401  (the methods' `backend` option lists them)
from .ops import FAR_FIELDS, muse_attention
from .plan import MusePlan, lloyd, make_plan
from .reference import muse_reference_planned
from .support import cells_supported, triton_supported

__all__ = ["cells_supported", "FAR_FIELDS", "MusePlan", "make_plan", "lloyd", "muse_attention", "muse_reference_planned",
           "triton_supported"]
