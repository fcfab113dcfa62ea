"""MoBA (Mixture of Block Attention) kernels: `reference` (PyTorch: the gating, token or block, and the block-sparse
exact attention), `ops` (the dispatch: `moba_attention`, whose block gating over a whole sequence runs on the
block-list Triton kernels of kernels/muse, `muse.listed_blocks_triton`; `moba_store_step` / `moba_decode`, a decode
step over a preallocated buffer whose block state is kept incrementally), `reference_decode` (that step in PyTorch;
`MobaStep`, what `moba_decode` attends with)
and `triton_decode` (its kernels: the store, the gate, one query per head over its selected blocks' slots).
docs/moba.md has the definition.
"""

from .ops import BACKENDS, moba_attention, moba_block_triton, moba_decode, moba_is_exact, moba_store_step
from .reference import GATINGS, moba_attended_keys, moba_reference
from .reference_decode import MobaStep, add_block_keys

__all__ = ["BACKENDS", "GATINGS", "MobaStep", "add_block_keys", "moba_attended_keys", "moba_attention", "moba_block_triton",
           "moba_decode", "moba_is_exact", "moba_reference", "moba_store_step"]
