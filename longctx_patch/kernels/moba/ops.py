"""The dispatch of MoBA attention: exact attention where MoBA cannot differ from it, else the PyTorch path.

There is no Triton kernel of MoBA yet: `backend` accepts "auto" and "torch", both the PyTorch path (dense logits
per chunk of queries under the MoBA mask: O(Sq * Sk) work, as exact attention, so no speed-up; see docs/moba.md).
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ..softmax import softmax_attention
from .reference import moba_reference

BACKENDS = ("auto", "torch")


def moba_is_exact(Sk: int, *, block_size: int, top_k: int, min_seq_len: int) -> bool:
    """Whether every query of a call over `Sk` keys attends to all its earlier keys: a query at position p < Sk has
    p // block_size earlier blocks, all selected while that is < top_k, and p < min_seq_len is exact by rule."""
    return Sk <= max(top_k * block_size, min_seq_len)


def moba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, block_size: int = 512,
                   top_k: int = 3, key_mask: torch.Tensor | None = None, q_offset: int | None = None,
                   min_seq_len: int = 0, backend: str = "auto") -> torch.Tensor:
    """MoBA attention (kernels/moba/reference.py has the definition); q `[B, Hq, Sq, D]`, k/v `[B, Hkv, Sk, D]`,
    key_mask `[B, Sk]` or None, query i at key index `q_offset + i` (default `Sk - Sq`; >= Sk: after every key, a
    decode step over a preallocated buffer). Returns `[B, Sq, Hq, D]`."""
    if backend not in BACKENDS:
        raise ConfigError(f"moba: backend must be one of {', '.join(BACKENDS)} (no Triton kernel yet), not {backend!r}")
    if block_size < 1 or top_k < 1:
        raise ConfigError(f"moba: block_size ({block_size}) and top_k ({top_k}) must be >= 1")
    if moba_is_exact(k.shape[2], block_size=block_size, top_k=top_k, min_seq_len=min_seq_len):
        return softmax_attention(q, k, v, scale=scale, key_mask=key_mask, q_offset=q_offset)
    return moba_reference(q, k, v, scale=scale, block_size=block_size, top_k=top_k, key_mask=key_mask,
                          q_offset=q_offset, min_seq_len=min_seq_len)


__all__ = ["BACKENDS", "moba_attention", "moba_is_exact"]
