"""The PyTorch reference of the few-query kernels: exact causal attention of the last queries against a long KV cache
under a key mask (padding) and an optional window, every score computed in float64 and masked.
`ops.masked_few_query_attention` must equal it (tests/test_decode_kernel.py).

The mask is the rule of `kernels.softmax.attention_mask`, written out here rather than imported: kernels/softmax/
dispatches to this folder, and the op folders import one another one way only.
"""

from __future__ import annotations

import torch


def masked_few_query_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                               key_mask: torch.Tensor | None = None, q_offset: int | None = None,
                               window: int | None = None) -> torch.Tensor:
    """`masked_few_query_attention`'s arguments (q `[B, Hq, Sq, D]`, query i at key `q_offset + i`, default the last
    keys; k/v `[B, Hkv, Sk, D]`; key_mask `[B, Sk]`, True = real) -> `[B, Sq, Hq, D]` in float64. A query sees the
    keys at or before its own position (the last `window` of them with a window) that are real, and always its own."""
    Sq, Sk = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    qpos = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq if q_offset is None else q_offset)
    kpos = torch.arange(Sk, device=q.device)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed = allowed & (kpos > qpos - window)
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = (allowed & key_mask[:, None, None, :].bool()) | (kpos == qpos)[None, None]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ kk.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2)


__all__ = ["masked_few_query_reference"]
