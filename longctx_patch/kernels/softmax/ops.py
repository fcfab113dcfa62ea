"""Exact causal softmax attention over plain tensors: `softmax_attention`, the dispatch over SDPA and the kernels.

The primitive of the `exact` and `sliding-window` methods, MuSe's exact tail, the attention-transfer teacher
(train/transfer.py) and the synthetic suite's softmax mixers. q `[B, Hq, Sq, D]`, k/v `[B, Hkv, Sk, D]` in,
`[B, Sq, Hq, D]` out; no method, cache or model object.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from ..window import banded_window_attention, use_banded, window_attention_triton, window_kernel_route
from .reference import attention_mask


# SDPA with a bottom-right causal bias passes `enable_gqa` on to its kernels (checked, not assumed, for older torch)
_LOWER_RIGHT_GQA = "enable_gqa" in inspect.signature(CausalBias._dispatch).parameters


def _without_cudnn(device):
    """SDPA's backends except cuDNN's attention on CUDA (a plan per new shape); nothing to change elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact causal softmax attention.

    q `[B, Hq, Sq, D]`, k/v `[B, Hkv, Sk, D]` (Hq a multiple of Hkv), key_mask `[B, Sk]` bool or None.
    Returns `[B, Sq, Hq, D]` in q's dtype (softmax in fp32 inside SDPA's math for fp32 inputs).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if use_banded(Sq, Sk, window):
        # many queries under a window (a windowed layer's prefill): O(S * W), not an S x S mask. Without a gradient
        # on CUDA the Triton forward (no bands or mask in memory); else banded blocks through SDPA (differentiable)
        if window_kernel_route(q, k, v):
            return window_attention_triton(q, k, v, scale=scale, window=window, key_mask=key_mask, q_offset=q_offset)
        return banded_window_attention(q, k, v, scale=scale, window=window, key_mask=key_mask, q_offset=q_offset)
    simple = key_mask is None and window is None and (q_offset is None or q_offset == Sk - Sq)
    if simple and 1 < Sq < Sk and (G == 1 or _LOWER_RIGHT_GQA):
        # the last Sq of Sk tokens, no padding or window (a prefill's tail, a chunk after a cache): causal aligned
        # to the bottom right, which SDPA's flash kernel takes without a mask and with the kv heads as they are
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Sq, Sk), scale=scale,
                                           enable_gqa=G > 1)
        return o.transpose(1, 2)
    if not simple and Sq < Sk and Sq * G <= Sk and q.is_cuda:
        # few queries under a mask (a padded batch's decode step or tail, a window): split-key Triton kernels,
        # since SDPA's masked kernels do not split the keys across the GPU (kernels/decode/)
        from ..decode import decode_kernel_supported, launch_masked_few_query

        if decode_kernel_supported(q, k, v) is None:
            return launch_masked_few_query(q, k, v, scale=scale, key_mask=key_mask, q_offset=q_offset, window=window, splits=None)
    if G > 1 and Sq * G <= Sk:
        # few queries (a decode step without padding; with a mask where the kernels above cannot run): the G query
        # heads of a kv head are stacked along the query axis (the mask repeated), so SDPA reads each kv head once
        # instead of G repeated copies of the cache, and a single last query that sees every key goes without a mask
        # (flash). cuDNN's attention is left out: it builds a plan for every new key length, 35-65 ms on an H200,
        # and a decode step is always a new length. Measured against SDPA's own GQA (`enable_gqa`) and the repeated
        # cache, with and without cuDNN, on a growing cache: the fastest with padding, and without padding level
        # with `enable_gqa` (0.07-0.14 ms host-bound calls at 16k-64k) and 2-11x faster than the repeated cache
        # (benchmarks/ops/bench_decode_attention.py, PERFORMANCE.md "Exact attention with few queries").
        mask = None
        if not (simple and Sq == 1):
            mask = attention_mask(Sq, Sk, device=q.device, key_mask=key_mask, q_offset=q_offset, window=window)
            mask = mask.repeat(1, 1, G, 1)
        with _without_cudnn(q.device):
            o = F.scaled_dot_product_attention(q.reshape(B, Hkv, G * Sq, D), k, v, attn_mask=mask, scale=scale)
        return o.reshape(B, Hq, Sq, D).transpose(1, 2)  # SDPA may return a non-contiguous layout
    if G > 1:
        k = k.repeat_interleave(G, dim=1)
        v = v.repeat_interleave(G, dim=1)
    if simple and Sq == Sk:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return o.transpose(1, 2)
    mask = None
    if not (simple and Sq == 1):
        mask = attention_mask(Sq, Sk, device=q.device, key_mask=key_mask, q_offset=q_offset, window=window)
    # with a cache (Sq < Sk) every call has a new key length: no cuDNN (a plan per length, see above)
    with _without_cudnn(q.device) if Sq < Sk else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


__all__ = ["softmax_attention"]
