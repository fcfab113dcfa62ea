"""Exact attention for a few queries against a long KV cache under a key mask: batched decode with padding, or a
padded prefill's last queries, on the split-key Triton kernels of `triton_decode.py` ("flash-decoding").

`softmax_attention` (kernels/softmax/) runs these on CUDA when the call needs a mask (a padded batch, a window):
SDPA's flash kernel takes no mask, its masked kernels do not split the keys across the GPU (6-16% of the
bandwidth ceiling at 64k), and cuDNN's builds a plan for every new cache length (PERFORMANCE.md, "Exact attention
with few queries"). Its PyTorch reference: `reference.masked_few_query_reference`, the dense attention under
`kernels.softmax.attention_mask`.
"""

from __future__ import annotations

import torch

from ..backend import attention_kernel_missing


def decode_kernel_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when `masked_few_query_attention` can run these tensors, else why not."""
    return attention_kernel_missing(q, k, v)


def masked_few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                               key_mask: torch.Tensor | None = None, q_offset: int | None = None,
                               window: int | None = None, splits: int | None = None,
                               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Exact causal attention of q `[B, Hq, Sq, D]` (the last queries, at keys `q_offset + i`) on k/v
    `[B, Hkv, Sk, D]`, with the mask of `kernels.softmax.attention_mask`; returns `[B, Sq, Hq, D]` in q's dtype.

    `positions` `[B, Hq, Sq]` (integers; no window with it): query i of head h in batch row b sits at key
    `positions[b, h, i]` instead (rows sampled anywhere in a prompt, per head: MuSe's guard), seeing the keys up to
    it. `splits` fixes the number of key splits (tests); by default enough programs for two per SM."""
    why = decode_kernel_supported(q, k, v)
    if why is not None:
        raise RuntimeError(f"masked_few_query_attention cannot run: {why}")
    return launch_masked_few_query(q, k, v, scale=scale, key_mask=key_mask, q_offset=q_offset, window=window,
                                   splits=splits, positions=positions)


def launch_masked_few_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                            key_mask: torch.Tensor | None = None, q_offset: int | None = None,
                            window: int | None = None, splits: int | None = None,
                            positions: torch.Tensor | None = None) -> torch.Tensor:
    """`masked_few_query_attention` without its check, for a caller that asked `decode_kernel_supported` itself
    (softmax_attention, MuSe's guard)."""
    from .triton_decode import split_attention

    if positions is not None and (window is not None or tuple(positions.shape) != (q.shape[0], q.shape[1], q.shape[2])):
        raise ValueError(f"positions {tuple(positions.shape)}: [B, Hq, Sq] = {tuple(q.shape[:3])}, without a window")
    return split_attention(q, k, v, scale=scale, key_mask=key_mask, q_offset=q_offset, window=window, splits=splits,
                           positions=positions)
