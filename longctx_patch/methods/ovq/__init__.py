"""`ovq`: online vector-quantised attention (dictionaries of keys and values learned in the forward pass).

Per chunk of `chunk_size` tokens, queries attend with one softmax over the dictionary keys D_k (bias
log count) and the chunk's own keys (exact, causal); values come from D_v and the chunk.  After each
chunk the dictionary absorbs it (growth toward `max_centroids`, spread-maximisation init of new rows,
count-weighted online k-means).  Decode state: D_k, D_v, counts and the open chunk, O(max_centroids +
chunk_size) whatever the context length.  Details and every design choice: docs/ovq.md.
"""

from ..base import Method, register_method
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


__all__ = ["OVQ", "OVQAttention", "OVQConfig", "OVQLayer", "row_phases"]
