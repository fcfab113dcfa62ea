"""The definition of exact causal softmax attention over plain tensors: its masks (`attention_mask`, `key_mask_for`)
and `softmax_reference`, dense float64 scores under that mask, which every exact path (`ops.softmax_attention`'s
routes, the banded window of kernels/window/, the few-query kernels of kernels/decode/) must equal.
"""

from __future__ import annotations

import torch


def attention_mask(
    q_len: int,
    k_len: int,
    *,
    device,
    key_mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    window: int | None = None,
) -> torch.Tensor | None:
    """Boolean mask `[B or 1, 1, q_len, k_len]` (True = attend) for causal (optionally windowed) attention.

    Query i sits at key index `q_offset + i` (default `k_len - q_len`: the queries are the last tokens).
    `key_mask` `[B, k_len]` marks real keys. A query always sees its own key, so a padded query row
    is never empty (its output is ignored anyway).
    """
    q_offset = k_len - q_len if q_offset is None else q_offset
    qpos = torch.arange(q_len, device=device)[:, None] + q_offset
    kpos = torch.arange(k_len, device=device)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed = allowed & (kpos > qpos - window)
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].bool()
        allowed = allowed | (kpos == qpos)[None, None]
    return allowed


def softmax_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact causal softmax attention computed densely in float64 (the kv heads repeated for GQA): q `[B, Hq, Sq, D]`,
    k/v `[B, Hkv, Sk, D]`, the mask of `attention_mask` -> `[B, Sq, Hq, D]` float64. For checks, not speed."""
    Sq, Sk = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    ok = attention_mask(Sq, Sk, device=q.device, key_mask=key_mask, q_offset=q_offset, window=window)
    s = s.masked_fill(~ok, float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2)


def key_mask_for(padding: torch.Tensor | None, k_len: int) -> torch.Tensor | None:
    """The last `k_len` columns of the padding mask (the keys an attention call sees), or None."""
    if padding is None:
        return None
    if padding.shape[1] < k_len:
        raise ValueError(f"padding mask covers {padding.shape[1]} tokens but attention sees {k_len} keys")
    return padding[:, padding.shape[1] - k_len :]


__all__ = ["attention_mask", "key_mask_for", "softmax_reference"]
