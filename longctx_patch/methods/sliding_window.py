"""`sliding-window`: exact softmax over the last `window` tokens, with a rolling KV cache.

The cache layer keeps at most `window - 1` past tokens: with the current token that is exactly `window`
keys per query at decode, and memory never grows with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import LongctxLayer
from .base import Method, MethodConfig, PatchedAttention, option, register_method
from .exact import key_mask_for, softmax_attention


@dataclass
class SlidingWindowConfig(MethodConfig):
    window: int = option(256, "number of most recent tokens (the current one included) each query attends to", min=1)


class RollingKVLayer(LongctxLayer):
    """Holds the K/V of the last `keep` tokens (`[B, Hkv, <=keep, D]`)."""

    state_names = ("keys", "values")

    def __init__(self, keep: int):
        super().__init__()
        self.keep = keep

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Returns (past + new keys, past + new values, number of past tokens in front), then rolls."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
            self.keys, self.values = k[:, :, :0], v[:, :, :0]
        past = self.keys.shape[2]
        k_all = torch.cat([self.keys, k], dim=2)
        v_all = torch.cat([self.values, v], dim=2)
        start = max(0, k_all.shape[2] - self.keep)
        self.keys, self.values = k_all[:, :, start:], v_all[:, :, start:]
        self.seen += k.shape[2]
        return k_all, v_all, past


class SlidingWindowAttention(PatchedAttention):
    method_name = "sliding-window"

    @classmethod
    def op(cls, q, k, v, *, scale, config):
        """Op-level entry point (see ExactAttention.op): windowed causal attention over one full sequence."""
        return softmax_attention(q, k, v, scale=scale, window=config.window)

    def attend(self, q, k, v, cache_layer, padding):
        w = self.method_config.window
        if cache_layer is None:
            return softmax_attention(q, k, v, scale=self.scaling, key_mask=key_mask_for(padding, k.shape[2]), window=w)
        if not isinstance(cache_layer, RollingKVLayer):
            raise TypeError(f"layer {self.layer_idx} is patched with sliding-window but its cache layer is "
                            f"{type(cache_layer).__name__}; pass no cache (one is created) or a LongctxCache")
        k_all, v_all, past = cache_layer.append(k, v)
        return softmax_attention(
            q, k_all, v_all, scale=self.scaling, key_mask=key_mask_for(padding, k_all.shape[2]), q_offset=past, window=w
        )

    def make_cache_layer(self):
        return RollingKVLayer(keep=self.method_config.window - 1)

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        return super().state_bytes(min(context_len, self.method_config.window - 1), batch, dtype)


@register_method
class SlidingWindow(Method):
    name = "sliding-window"
    description = "exact softmax over the last `window` tokens; rolling KV cache of window-1 tokens"
    config_cls = SlidingWindowConfig
    module_cls = SlidingWindowAttention
