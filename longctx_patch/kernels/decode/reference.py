"""The PyTorch reference of the few-query kernels: exact causal attention of the last queries against a long KV cache
under a key mask (padding) and an optional window, computed densely in float64 under the mask of
`kernels.softmax.attention_mask`. `ops.masked_few_query_attention` must equal it (tests/test_decode_kernel.py).
"""

from __future__ import annotations

import torch

from ..softmax.reference import softmax_reference


def masked_few_query_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                               key_mask: torch.Tensor | None = None, q_offset: int | None = None,
                               window: int | None = None) -> torch.Tensor:
    """`masked_few_query_attention`'s arguments (q `[B, Hq, Sq, D]` at keys `q_offset + i`, k/v `[B, Hkv, Sk, D]`,
    key_mask `[B, Sk]`) -> `[B, Sq, Hq, D]` in float64: every score computed, masked, softmaxed (no key splits)."""
    return softmax_reference(q, k, v, scale=scale, key_mask=key_mask, q_offset=q_offset, window=window)


__all__ = ["masked_few_query_reference"]
