"""`sliding-window`: exact softmax over the last `window` tokens, with a ring KV cache.

The cache layer (methods/kv_layer.py) holds at most `window` slots: a decode step overwrites the oldest token
with the current one and attends to exactly `window` keys, and memory never grows with the context.
"""

from ..base import Method, register_method
from ..kv_layer import KVBufferLayer
from .attention import SlidingWindowAttention
from .config import SlidingWindowConfig


@register_method
class SlidingWindow(Method):
    name = "sliding-window"
    description = "exact softmax over the last `window` tokens; ring KV cache of window tokens"
    config_cls = SlidingWindowConfig
    module_cls = SlidingWindowAttention
    keeps_model_window = True  # the smaller of the two windows (SlidingWindowAttention.window)
    bounded_state = True


__all__ = ["KVBufferLayer", "SlidingWindow", "SlidingWindowAttention", "SlidingWindowConfig"]
