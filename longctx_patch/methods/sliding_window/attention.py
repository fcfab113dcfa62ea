"""`sliding-window`: exact softmax over the last `window` tokens, with a ring KV cache.

The cache layer (methods/kv_layer.py) holds at most `window` slots: a decode step overwrites the oldest token
with the current one and attends to exactly `window` keys, and memory never grows with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import Method, MethodConfig, option, register_method
from ...kernels.softmax import softmax_attention
from ..exact import ExactAttention
from ..kv_layer import KVBufferLayer

__all__ = ["KVBufferLayer", "SlidingWindow", "SlidingWindowAttention", "SlidingWindowConfig"]


@dataclass
class SlidingWindowConfig(MethodConfig):
    window: int = option(256, "number of most recent tokens (the current one included) each query attends to", min=1)


class SlidingWindowAttention(ExactAttention):
    """Exact attention (methods/exact.py) under `window`; on a layer the model itself windows, the smaller of
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


@register_method
class SlidingWindow(Method):
    name = "sliding-window"
    description = "exact softmax over the last `window` tokens; ring KV cache of window tokens"
    config_cls = SlidingWindowConfig
    module_cls = SlidingWindowAttention
    keeps_model_window = True  # the smaller of the two windows (SlidingWindowAttention.window)
