"""MoBA (Mixture of Block Attention) kernels: `reference` (PyTorch: the gating, token or block, and the block-sparse
exact attention), `ops` (the dispatch `moba_attention`; block gating over a whole sequence runs on the block-list
Triton kernels of kernels/muse, `muse.listed_blocks_triton`: MoBA has no Triton file of its own). docs/moba.md has
the definition.
"""

from .ops import BACKENDS, moba_attention, moba_block_triton, moba_is_exact
from .reference import GATINGS, moba_attended_keys, moba_reference

__all__ = ["BACKENDS", "GATINGS", "moba_attention", "moba_block_triton", "moba_attended_keys", "moba_is_exact",
           "moba_reference"]
