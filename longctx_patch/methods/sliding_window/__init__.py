"""`sliding-window`: exact softmax over the last `window` tokens, with a ring KV cache."""

from .attention import KVBufferLayer, SlidingWindow, SlidingWindowAttention, SlidingWindowConfig

__all__ = ["KVBufferLayer", "SlidingWindow", "SlidingWindowAttention", "SlidingWindowConfig"]
