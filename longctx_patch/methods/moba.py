"""`moba`: Mixture of Block Attention (MoBA, Lu et al. 2025), the block-sparse baseline MuSe is compared with.

Every query token attends exactly to its own block (causally) and to the `top_k - 1` earlier blocks whose mean key
scores highest against it (kernels/moba; docs/moba.md). Prefill, continued prefill and decode steps all apply
the same per-token rule, over a preallocated full KV cache (`KVBufferLayer`, as `exact`): a decode step gates the
cache's blocks with its one query, so `generate()` equals recomputing the sequence. A left-padded row has the
blocks of its prompt alone: block boundaries are counted in each row's real positions. No new parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..kernels.moba import BACKENDS, moba_attention
from .base import Method, MethodConfig, option, register_method
from .exact import ExactAttention


@dataclass
class MobaConfig(MethodConfig):
    block_size: int = option(512, "tokens per block (block boundaries at multiples of this in each row's real "
                             "positions); 512: the MoBA paper's block size with top_k 3", min=1)
    top_k: int = option(3, "blocks each query token attends, its own (causal) block included, as MoBA counts them: "
                        "the own block plus the top_k - 1 earlier blocks of highest q . mean key", min=1)
    min_seq_len: int = option(0, "query tokens at positions below this attend to every earlier key (exact); "
                              "positions below top_k * block_size are exact anyway", min=0)
    backend: str = option("auto", "auto or torch: the PyTorch path (no Triton kernel of MoBA yet)",
                          choices=list(BACKENDS))

    def check(self) -> None:
        if self.block_size < 1 or self.top_k < 1:
            raise ConfigError("MobaConfig: block_size and top_k must be >= 1")

    def kernel_kwargs(self) -> dict:
        return dict(block_size=self.block_size, top_k=self.top_k, min_seq_len=self.min_seq_len, backend=self.backend)


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

    def attention(self, q, k, v, *, key_mask, q_offset, window):
        return moba_attention(q, k, v, scale=self.scaling, key_mask=key_mask, q_offset=q_offset,
                              **self.method_config.kernel_kwargs())


@register_method
class Moba(Method):
    name = "moba"
    description = ("mixture of block attention (MoBA): each query attends its own block and the top-k earlier "
                   "blocks by mean-key gating, exactly; full KV cache")
    config_cls = MobaConfig
    module_cls = MobaAttention
    window_conflict = "approximates full causal attention (blocks gated over the whole past)"


__all__ = ["MobaConfig", "MobaAttention", "Moba"]
