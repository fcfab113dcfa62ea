"""MoBA (Mixture of Block Attention) kernels: `reference` (PyTorch: the gating, the block-sparse exact attention),
`ops` (the dispatch `moba_attention`). No Triton kernel yet. docs/moba.md has the definition.
"""

from .ops import BACKENDS, moba_attention, moba_is_exact
from .reference import moba_reference

__all__ = ["BACKENDS", "moba_attention", "moba_is_exact", "moba_reference"]
