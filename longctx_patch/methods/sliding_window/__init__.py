"""`sliding-window`: exact softmax over the last `window` tokens, with a ring KV cache.

The cache layer (methods/kv_layer.py) holds at most `window` slots: a decode step overwrites the oldest token
with the current one and attends to exactly `window` keys, and memory never grows with the context.
"""

from ..base import Approximation, Method, register_method
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

    def approximation_start(self, config, device_type="cpu", head_dim=64) -> Approximation:
        w = int(config.window)
        return Approximation(w + 1, w, f"keys more than window={w} tokens back are dropped")

    def attention_profile(self, config, head_dim, seq_len, kernels) -> tuple[float, float]:
        return min(int(config.window), seq_len / 2), 4 * head_dim  # SDPA's banded form: output and row statistics


__all__ = ["KVBufferLayer", "SlidingWindow", "SlidingWindowAttention", "SlidingWindowConfig"]
