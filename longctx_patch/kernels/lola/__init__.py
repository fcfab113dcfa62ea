"""LoLCATs hybrid attention and the LoLA sparse cache: PyTorch references, Triton kernels, dispatchers.

See docs/lola.md. `reference` holds the differentiable PyTorch paths, `triton_hybrid` / `triton_state` /
`triton_evict` the kernels that must match them (`triton_kernels`: their entry points in one namespace), `ops` the
dispatchers of the feature map and the whole-sequence hybrid, `state` the decode state (`LolaState`) and its
operations, `sparse_cache` the state machine that sequences them (`lola_process`), `prefill` the parallel
prefills, `padded` the eviction grids of left-padded rows, `tuning` the kernels' launch settings. The settings of a
call travel as one object beside its tensors: `HybridSpec` (the whole-sequence hybrid), `LolaRun` (the LoLA state
machine), `StateSizes` (a state's sizes), `training.SetsSpec` (the training pass over sparse sets).
"""

from .ops import hybrid_attention
from .reference import HybridSpec, hedgehog_feature_map
from .sparse_cache import lola_process
from .state import LolaRun, LolaState, StateSizes, lola_evict

__all__ = ["HybridSpec", "LolaRun", "LolaState", "StateSizes", "hedgehog_feature_map", "hybrid_attention",
           "lola_evict", "lola_process"]
