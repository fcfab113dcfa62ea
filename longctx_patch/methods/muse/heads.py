"""Per-head exact attention over MuSe's output: what `exact_heads` (a calibration's choice) and the run-time guard
(guard.py) give the heads they name."""

from __future__ import annotations

import torch

from ...kernels.softmax import softmax_attention


def with_exact_heads(o, q, k, v, heads, *, scale: float, key_mask=None):
    """`o` [B, S, Hq, D] with the query heads `heads` replaced by exact causal attention (each query head with its kv
    head, GQA); `o` itself when `heads` is empty. Out of place, so gradients flow through both parts."""
    if not heads:
        return o
    G = q.shape[1] // k.shape[1]
    idx = torch.tensor(heads, device=q.device)
    kv = torch.div(idx, G, rounding_mode="floor")
    exact = softmax_attention(q.index_select(1, idx), k.index_select(1, kv), v.index_select(1, kv), scale=scale,
                              key_mask=key_mask)
    return o.index_copy(2, idx, exact.to(o.dtype))


__all__ = ["with_exact_heads"]
