"""`moba`: Mixture of Block Attention (MoBA, Lu et al. 2025), the block-sparse baseline MuSe is compared with.

Every query attends exactly to its own block (causally) and to the `top_k - 1` earlier blocks whose mean key
scores highest against its gate: per query block (`gating="block"`, the default: the block's mean query; the
block-list Triton kernels on CUDA) or per query token (`gating="token"`, MoBA's reference rule; PyTorch only)
(kernels/moba; docs/moba.md). The cache is a preallocated full KV cache (`KVBufferLayer`, as `exact`); with block
gating it also holds the sum of the current block's queries (`MobaLayer`), so that a decode step is gated by the
mean of its block's queries up to itself, as a prefill ending at that token gates it. A left-padded row has the
blocks of its prompt alone: block boundaries are counted in each row's real positions. No new parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ...kernels.moba import BACKENDS, GATINGS, moba_attention
from ..base import Method, MethodConfig, option, register_method
from ..exact import ExactAttention
from ..kv_layer import KVBufferLayer


@dataclass
class MobaConfig(MethodConfig):
    block_size: int = option(512, "tokens per block (block boundaries at multiples of this in each row's real "
                             "positions); 512: the MoBA paper's block size with top_k 3", min=1)
    top_k: int = option(3, "blocks each query token attends, its own (causal) block included, as MoBA counts them: "
                        "the own block plus the top_k - 1 earlier blocks of highest q . mean key", min=1)
    min_seq_len: int = option(0, "query tokens at positions below this attend to every earlier key (exact); "
                              "positions below top_k * block_size are exact anyway", min=0)
    gating: str = option("block", "block: each block of block_size queries is gated by its mean query and all its "
                         "queries attend the same blocks (the Triton path); token: each query is gated by itself "
                         "(MoBA's reference rule, PyTorch only)", choices=list(GATINGS))
    backend: str = option("auto", "auto (Triton on CUDA where it runs: block gating over a whole sequence, "
                          "block_size a multiple of 128, head_dim <= 128; else PyTorch), torch, or triton",
                          choices=list(BACKENDS))

    def check(self) -> None:
        if self.block_size < 1 or self.top_k < 1:
            raise ConfigError("MobaConfig: block_size and top_k must be >= 1")

    def kernel_kwargs(self) -> dict:
        return dict(block_size=self.block_size, top_k=self.top_k, min_seq_len=self.min_seq_len, gating=self.gating,
                    backend=self.backend)


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


class MobaLayer(KVBufferLayer):
    """The full KV cache plus, for block gating, `query_sum` `[B, Hq, D]` fp32: the sum of the queries of each
    row's current (incomplete) block, which `moba_attention` updates in place (a decode step too, so it replays
    from CUDA graphs). Not croppable: the queries of dropped tokens cannot be taken out of the sum."""

    state_names = KVBufferLayer.state_names + ("query_sum",)
    is_croppable = False

    def query_sum_like(self, q: torch.Tensor) -> torch.Tensor:
        if self.query_sum is None:
            B, Hq, _, D = q.shape
            self.query_sum = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
        return self.query_sum

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a moba cache with gating='block' cannot drop tokens (it holds the sum of the "
                                  "current block's queries); use gating='token' for assisted or speculative decoding")


@register_method
class Moba(Method):
    name = "moba"
    description = ("mixture of block attention (MoBA): each query (block) attends its own block and the top-k "
                   "earlier blocks by mean-key gating, exactly; full KV cache")
    config_cls = MobaConfig
    module_cls = MobaAttention
    window_conflict = "approximates full causal attention (blocks gated over the whole past)"


__all__ = ["MobaConfig", "MobaAttention", "MobaLayer", "Moba"]
