"""MoBA (Mixture of Block Attention) kernels: `reference` (PyTorch: the gating, token or block, the block-sparse
exact attention, and a decode step's gate from incrementally kept block sums), `ops` (the dispatch `moba_attention`;
block gating over a whole sequence runs on the block-list Triton kernels of kernels/muse, `muse.listed_blocks_triton`;
`moba_decode`, one decode step over a preallocated buffer), `triton_decode` (the decode kernel: one query per head
over its selected blocks' slots). docs/moba.md has the definition.
"""

from .ops import BACKENDS, moba_attention, moba_block_triton, moba_decode, moba_is_exact
from .reference import GATINGS, moba_reference

__all__ = ["BACKENDS", "GATINGS", "moba_attention", "moba_block_triton", "moba_decode", "moba_is_exact",
           "moba_reference"]
