"""Exact attention of a few queries under a key mask (batched decode with padding): `reference` (the dense PyTorch
definition the kernels must equal), `ops` (the check and the dispatch), `triton_decode` (the split-key kernels)."""

from .ops import decode_kernel_supported, launch_masked_few_query, masked_few_query_attention
from .reference import masked_few_query_reference

__all__ = ["decode_kernel_supported", "launch_masked_few_query", "masked_few_query_attention",
           "masked_few_query_reference"]
