"""Sliding-window attention's dispatch: when the banded form pays (`use_banded`), and the Triton forward
(`window_attention_triton`, kernels in `triton_window.py`) with its checks.

`softmax_attention` (kernels/softmax/) routes windowed calls with many queries to the banded form of `reference.py`
(`banded_window_attention`: blocks of queries against their bands of keys through SDPA, differentiable). Where no
gradient is needed on CUDA it takes `window_attention_triton` instead: a flash-style Triton forward that reads q, k, v
once and materialises neither the bands nor the mask.
"""

from __future__ import annotations

import torch

from ..backend import attention_kernel_missing
from .options import WindowTiles
from .reference import band_block


def use_banded(q_len: int, k_len: int, window: int | None) -> bool:
    """True when the banded form does less work than one masked problem: many queries and keys beyond a band."""
    if window is None or q_len <= band_block(window):
        return False
    return k_len > window + 2 * band_block(window)


def window_kernel_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when `window_attention_triton` can run these tensors, else why not."""
    why = attention_kernel_missing(q, k, v)
    if why is not None:
        return why
    D = q.shape[-1]
    if k.shape[-1] != D or v.shape[-1] != D:
        return f"head_dim {D} (k {k.shape[-1]}, v {v.shape[-1]}): one power of two in 16..256"
    if q.shape[0] * k.shape[1] > 65535:
        return f"batch x kv heads {q.shape[0] * k.shape[1]}: at most 65535 (the grid's second axis)"
    return None


def window_kernel_route(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `softmax_attention` takes the Triton kernel for a banded call: CUDA tensors (on a CPU the
    interpreter is for tests, which call `window_attention_triton` directly) and the kernel supports them."""
    return q.is_cuda and window_kernel_supported(q, k, v) is None


def window_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int,
    key_mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    tiles: WindowTiles | None = None,
) -> torch.Tensor:
    """`banded_window_attention` (same arguments, mask and `[B, Sq, Hq, D]` result in q's dtype) through the Triton
    forward kernel of `triton_window.py`: O(S * W) work, q/k/v read once, no bands or mask in memory; no backward.
    `tiles`: launch tiles in place of the defaults (`WindowTiles`; benchmarks and tests)."""
    why = window_kernel_supported(q, k, v)
    if why is not None:
        raise RuntimeError(f"window_attention_triton cannot run: {why}")
    Sq, Sk = q.shape[2], k.shape[2]
    o0 = Sk - Sq if q_offset is None else int(q_offset)
    if not (0 <= o0 and o0 + Sq <= Sk):
        raise ValueError(f"queries at key positions {o0}..{o0 + Sq - 1} do not lie within the {Sk} keys")
    if int(window) < 1:
        raise ValueError(f"window {window}: at least 1 (a query's own key)")
    if tiles is not None and not isinstance(tiles, WindowTiles):
        raise TypeError(f"tiles={tiles!r}: a WindowTiles (or None: the defaults)")
    from .triton_window import window_forward

    return window_forward(q, k, v, scale=scale, window=window, key_mask=key_mask, q_offset=o0, tiles=tiles)


__all__ = ["use_banded", "window_attention_triton", "window_kernel_route", "window_kernel_supported"]
