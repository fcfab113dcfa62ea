"""Exact attention of a few queries under a key mask (batched decode with padding): `reference` (the dense PyTorch
definition the kernels must equal), `ops` (the check and the dispatch), `triton_decode` (the split-key kernels).

`reference` is imported by name (`kernels.decode.reference`), not here: it is built on kernels/softmax/, whose dispatch
comes back to this package for its few-query calls."""

from .ops import decode_kernel_supported, launch_masked_few_query, masked_few_query_attention

__all__ = ["decode_kernel_supported", "launch_masked_few_query", "masked_few_query_attention"]
