"""LoLCATs hybrid attention and the LoLA sparse-cache manager: PyTorch references, Triton kernels, dispatchers.

See docs/lola.md. `reference` holds the differentiable PyTorch paths, `triton_hybrid` / `triton_state` /
`triton_evict` the kernels that must match them (`triton_kernels`: their entry points in one namespace), `ops` the
dispatchers and the cache manager (`LolaState`, `lola_process`), `tuning` the kernels' launch settings.
"""

from .ops import LolaState, hybrid_attention, lola_evict, lola_process
from .reference import hedgehog_feature_map

__all__ = ["LolaState", "hedgehog_feature_map", "hybrid_attention", "lola_evict", "lola_process"]
