"""Exact causal softmax attention over plain tensors: `reference` (its masks and the dense float64 definition every
exact path must equal), `ops` (`softmax_attention`: the dispatch over SDPA, the banded window of kernels/window/ and
the few-query kernels of kernels/decode/)."""

from .ops import softmax_attention
from .reference import attention_mask, key_mask_for, softmax_reference

__all__ = ["attention_mask", "key_mask_for", "softmax_attention", "softmax_reference"]
