"""`exact`'s module: exact causal softmax attention (kernels/softmax/) over a preallocated K/V cache."""

from __future__ import annotations

import torch

from ...kernels.softmax import key_mask_for, softmax_attention
from ..base import PatchedAttention
from ..kv_layer import KVBufferLayer, kv_buffer_bytes


class ExactAttention(PatchedAttention):
    """Exact causal softmax attention; on a layer the original model windows (`spec.sliding_window`), the same
    window. Its cache is a preallocated `KVBufferLayer` (methods/kv_layer.py; for a window, a ring of `window`
    slots), so its decode steps write in place and can be replayed from CUDA graphs."""

    method_name = "exact"

    @property
    def window(self) -> int | None:
        """Keys per query, its own included (None: all earlier keys)."""
        return self.spec.sliding_window

    @classmethod
    def op(cls, q, k, v, *, scale, config):
        """Op-level entry point (used by `longctx eval speed --op`): causal attention over one full sequence,
        q `[B, Hq, S, D]`, k/v `[B, Hkv, S, D]`, no cache or padding; returns `[B, S, Hq, D]`."""
        return softmax_attention(q, k, v, scale=scale)

    def attend(self, q, k, v, cache_layer, padding):
        if isinstance(cache_layer, KVBufferLayer):
            kv = cache_layer.extend(k, v, padding)
            return self.attention(q, kv.keys, kv.values, key_mask=kv.key_mask, q_offset=kv.q_offset, window=kv.window)
        if cache_layer is not None:  # a cache layer of transformers' own (a DynamicLayer handed in by a caller)
            k, v = cache_layer.update(k, v)
        # the queries are the last keys
        return self.attention(q, k, v, key_mask=key_mask_for(padding, k.shape[2]), q_offset=None, window=self.window)

    def attention(self, q, k, v, *, key_mask, q_offset, window):
        """The attention of `attend` over the keys it gathered (`kernels.softmax.softmax_attention`'s arguments):
        exact softmax here; a method that keeps this full KV cache and changes only the attention overrides it."""
        return softmax_attention(q, k, v, scale=self.scaling, key_mask=key_mask, q_offset=q_offset, window=window)

    def make_cache_layer(self):
        return KVBufferLayer(window=self.window)

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        """What the buffer a prefill of `context_len` tokens allocates holds (its capacity, not its fill)."""
        return kv_buffer_bytes(context_len, batch, self.num_key_value_heads, self.head_dim, dtype, self.window)


__all__ = ["ExactAttention"]
