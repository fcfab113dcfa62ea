"""`moba`: Mixture of Block Attention (MoBA, Lu et al. 2025), the block-sparse baseline MuSe is compared with.

Every query attends exactly to its own block (causally) and to the `top_k - 1` earlier blocks whose mean key
scores highest against its gate: per query block (`gating="block"`, the default: the block's mean query; the
block-list Triton kernels on CUDA) or per query token (`gating="token"`, MoBA's reference rule; PyTorch only)
(kernels/moba; docs/moba.md). The cache is a preallocated full KV cache (`KVBufferLayer`, as `exact`); with block
gating it also holds the block state (`MobaLayer`: the sum of the current block's queries, each block's key sum and
first slot), so that a decode step is gated by the mean of its block's queries up to itself, as a prefill ending at
that token gates it, without a pass over the keys, and reads only its selected blocks. A left-padded row has the
blocks of its prompt alone: block boundaries are counted in each row's real positions. No new parameters.
"""

from ..base import Approximation, Method, register_method
from .attention import MobaAttention
from .cache import MobaLayer
from .config import MobaConfig


@register_method
class Moba(Method):
    name = "moba"
    description = ("mixture of block attention (MoBA): each query (block) attends its own block and the top-k "
                   "earlier blocks by mean-key gating, exactly; full KV cache")
    config_cls = MobaConfig
    module_cls = MobaAttention
    window_conflict = "approximates full causal attention (blocks gated over the whole past)"

    def approximation_start(self, config, device_type="cpu", head_dim=64) -> Approximation:
        bs, k = int(config.block_size), int(config.top_k)
        first = max(int(config.min_seq_len), k * bs)
        return Approximation(first + 1, first, (
            f"a query block attends its own and top_k - 1 = {k - 1} earlier blocks of block_size={bs}, so the choice "
            f"starts at block {k} (token {k * bs})"
            + (f", past min_seq_len={config.min_seq_len}" if config.min_seq_len > k * bs else "")))

    def attention_profile(self, config, head_dim, seq_len, kernels) -> tuple[float, float]:
        keys = min(int(config.block_size) * int(config.top_k), seq_len / 2)
        return keys, (4 * head_dim if kernels else 3 * seq_len)  # the reference: every score, its mask and weights


__all__ = ["Moba", "MobaAttention", "MobaConfig", "MobaLayer"]
