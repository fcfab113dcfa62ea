"""Exact causal softmax attention over plain tensors: `ops` (`softmax_attention`, the dispatch over SDPA, the
banded window of kernels/window/ and the few-query kernels of kernels/decode/) and its masks."""

from .ops import attention_mask, key_mask_for, softmax_attention

__all__ = ["attention_mask", "key_mask_for", "softmax_attention"]
