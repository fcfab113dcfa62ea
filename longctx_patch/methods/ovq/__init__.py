"""`ovq`: online vector-quantised attention (dictionaries of keys and values learned in the forward pass).

Per chunk of `chunk_size` tokens, queries attend with one softmax over the dictionary keys D_k (bias
log count) and the chunk's own keys (exact, causal); values come from D_v and the chunk.  After each
chunk the dictionary absorbs it (growth toward `max_centroids`, spread-maximisation init of new rows,
count-weighted online k-means).  Decode state: D_k, D_v, counts and the open chunk, O(max_centroids +
chunk_size) whatever the context length.  Details and every design choice: docs/ovq.md.
"""

from ..base import Approximation, Method, register_method
from .attention import OVQAttention, row_phases
from .cache import OVQLayer
from .config import OVQConfig


@register_method
class OVQ(Method):
    name = "ovq"
    description = ("online vector-quantised attention: chunked exact attention + key/value dictionaries "
                   "learned online; state O(max_centroids + chunk_size)")
    config_cls = OVQConfig
    module_cls = OVQAttention
    window_conflict = "attends to a dictionary of every earlier chunk"
    bounded_state = True
    state_options = ("max_centroids", "chunk_size")

    def approximation_start(self, config, device_type="cpu", head_dim=64) -> Approximation:
        c = int(config.chunk_size)
        return Approximation(c + 1, c, f"keys of earlier chunks (chunk_size={c}) are read through the dictionary")

    def attention_profile(self, config, head_dim, seq_len, kernels) -> tuple[float, float]:
        chunk, n = int(config.chunk_size), int(config.max_centroids)
        return chunk / 2 + n, (4 * head_dim if kernels else 3 * (chunk + n))  # the chunk's keys and the dictionary


__all__ = ["OVQ", "OVQAttention", "OVQConfig", "OVQLayer", "row_phases"]
