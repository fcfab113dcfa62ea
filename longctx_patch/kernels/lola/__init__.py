"""LoLCATs hybrid attention and the LoLA sparse-cache manager: PyTorch references, Triton kernels, dispatchers.

See docs/lola.md. `reference` holds the differentiable PyTorch paths, `triton_kernels` the kernels that must
match them, `ops` the dispatchers and the cache manager (`LolaState`, `lola_process`).
"""

from .ops import LolaState, hybrid_attention, lola_evict, lola_process
from .reference import hedgehog_feature_map

__all__ = ["LolaState", "hedgehog_feature_map", "hybrid_attention", "lola_evict", "lola_process"]
