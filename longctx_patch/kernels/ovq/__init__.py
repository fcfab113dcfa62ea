"""OVQ (online vector-quantised) attention kernels: PyTorch reference, Triton kernels, driver."""
from .ops import OpenChunk, ovq_attention, resolve_backend, target_int
from .reference import (OVQState, chunk_attention_ref, exact_causal_attention, target_centroids,
                        update_state, update_state_loop)

__all__ = ["OVQState", "OpenChunk", "ovq_attention", "resolve_backend", "target_int", "chunk_attention_ref",
           "exact_causal_attention", "target_centroids", "update_state", "update_state_loop"]
