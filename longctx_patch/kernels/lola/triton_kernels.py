"""The entry points of the LoLCATs / LoLA Triton kernels, one namespace for `ops.py` and the benchmarks
(benchmarks/ops/bench_lola.py), by family:

  triton_hybrid.py      hybrid_fwd, decode_step, feature_map  (the attention, forward)
  triton_hybrid_bwd.py  hybrid_bwd  (the backward of the whole-sequence hybrid: `ops.HybridAttentionFn`)
  triton_feature_map_bwd.py  feature_map_bwd  (the feature map's backward: `ops.FeatureMapFn`)
  triton_state.py       chunk_states, fold_into_state, local_states  (the linear state)
  triton_evict.py       sre_score, PrefillEvictions, EvictionPlan  (the evictions)

Each takes `tuning=` (tuning.LolaTuning: its launch settings; the defaults unless a caller passes others). Imported
only once the backend chose "triton".
"""

from .triton_evict import EvictionPlan, PrefillEvictions, sre_score
from .triton_feature_map_bwd import feature_map_bwd
from .triton_hybrid import decode_step, feature_map, hybrid_fwd
from .triton_hybrid_bwd import hybrid_bwd
from .triton_state import chunk_states, fold_into_state, local_states

__all__ = ["EvictionPlan", "PrefillEvictions", "chunk_states", "decode_step", "feature_map", "feature_map_bwd",
           "fold_into_state", "hybrid_bwd", "hybrid_fwd", "local_states", "sre_score"]
