"""`moba`'s module: MoBA over `exact`'s full KV cache (`MobaLayer` for block gating, whose decode steps gate from
the block state it keeps and read the selected blocks only)."""

from __future__ import annotations

import torch

from ...kernels.moba import moba_attention, moba_decode
from ..exact.attention import ExactAttention
from ..kv_layer import KVBufferLayer, capacity_for
from .cache import MobaLayer, blocks_for


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
        cfg = self.method_config
        if q.shape[2] == 1 and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
            # a decode step: gated from the cache's block state, over the selected blocks only
            return moba_decode(q, cache_layer.decode_step(k, v, padding), scale=self.scaling,
                               block_size=cfg.block_size, top_k=cfg.top_k, min_seq_len=cfg.min_seq_len,
                               gating="block", query_sum=query_sum, backend=cfg.backend)
        kv = cache_layer.extend(k, v, padding)
        return moba_attention(q, kv.keys, kv.values, scale=self.scaling, key_mask=kv.key_mask, q_offset=kv.q_offset,
                              query_sum=query_sum, **self.method_config.kernel_kwargs())

    def attention(self, q, k, v, *, key_mask, q_offset, window):
        return moba_attention(q, k, v, scale=self.scaling, key_mask=key_mask, q_offset=q_offset,
                              **self.method_config.kernel_kwargs())

    def make_cache_layer(self):
        cfg = self.method_config
        return MobaLayer(block_size=cfg.block_size, backend=cfg.backend) if cfg.gating == "block" else KVBufferLayer()

    def state_bytes(self, context_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
        """The KV buffer and, for block gating, `MobaLayer`'s block state: the query sum, the key sums of
        ceil(capacity / block_size) blocks (fp32, float64 for a float64 model), their first slots and the real
        count."""
        extra = 0
        if self.method_config.gating == "block":
            nb = blocks_for(capacity_for(context_len), self.method_config.block_size)
            w = 8 if dtype == torch.float64 else 4
            extra = batch * (self.num_heads * self.head_dim * w + self.num_key_value_heads * nb * self.head_dim * w
                             + nb * 8 + 8)
        return super().state_bytes(context_len, batch, dtype) + extra


__all__ = ["MobaAttention"]
