"""`moba`'s module: MoBA over `exact`'s full KV cache (`MobaLayer` for block gating)."""

from __future__ import annotations

import torch

from ...kernels.moba import moba_attention
from ..exact.attention import ExactAttention
from ..kv_layer import KVBufferLayer
from .cache import MobaLayer


class MobaAttention(ExactAttention):
    """MoBA over `exact`'s full KV cache (`ExactAttention.attend`, `make_cache_layer`, `state_bytes`): only the
    attention over the gathered keys differs. MoBA refuses windowed layers (`Moba.window_conflict`), so no window
    reaches it."""

    method_name = "moba"

    @classmethod
    def op(cls, q, k, v, *, scale, config):
        """Op-level entry point (`longctx eval speed --op`): MoBA over one full causal sequence, q `[B, Hq, S, D]`,
        k/v `[B, Hkv, S, D]` -> `[B, S, Hq, D]`."""
        return moba_attention(q, k, v, scale=scale, **config.kernel_kwargs())

    def attend(self, q, k, v, cache_layer, padding):
        if not isinstance(cache_layer, MobaLayer):  # token gating, no cache, or a transformers layer
            return super().attend(q, k, v, cache_layer, padding)
        query_sum = cache_layer.query_sum_like(q)
        kv = cache_layer.extend(k, v, padding)
        return moba_attention(q, kv.keys, kv.values, scale=self.scaling, key_mask=kv.key_mask, q_offset=kv.q_offset,
                              query_sum=query_sum, **self.method_config.kernel_kwargs())

    def attention(self, q, k, v, *, key_mask, q_offset, window):
        return moba_attention(q, k, v, scale=self.scaling, key_mask=key_mask, q_offset=q_offset,
                              **self.method_config.kernel_kwargs())

    def make_cache_layer(self):
        return MobaLayer() if self.method_config.gating == "block" else KVBufferLayer()

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        extra = batch * self.num_heads * self.head_dim * 4 if self.method_config.gating == "block" else 0
        return super().state_bytes(context_len, batch, dtype) + extra


__all__ = ["MobaAttention"]
