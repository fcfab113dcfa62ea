"""`sliding-window`'s module: `exact`'s attention and cache under a window."""

from __future__ import annotations

from ...kernels.softmax import softmax_attention
from ..exact.attention import ExactAttention


class SlidingWindowAttention(ExactAttention):
    """Exact attention (methods/exact/) under `window`; on a layer the model itself windows, the smaller of
    the two windows (the model's window is part of the layer's exact attention)."""

    method_name = "sliding-window"

    @property
    def window(self) -> int:
        own = self.spec.sliding_window
        return self.method_config.window if own is None else min(self.method_config.window, own)

    @classmethod
    def op(cls, q, k, v, *, scale, config):
        """Op-level entry point (see ExactAttention.op): windowed causal attention over one full sequence."""
        return softmax_attention(q, k, v, scale=scale, window=config.window)


__all__ = ["SlidingWindowAttention"]
