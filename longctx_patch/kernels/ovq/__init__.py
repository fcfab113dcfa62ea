"""OVQ (online vector-quantised) attention: `reference` (PyTorch), `ops` (the driver, its backend choice and the
chunk attention's `autograd.Function`), `options` (`OvqKernelOptions`: how the kernels run, passed as `options=`),
`triton_attn` / `triton_dict` / `triton_fast` (the kernels)."""
from .ops import (OpenChunk, chunk_attention_triton, ovq_attention, ovq_attention_phased, ovq_open_attention,
                  phase_open_len, resolve_backend)
from .options import OvqKernelOptions
from .reference import (OVQState, chunk_attention_ref, exact_causal_attention, target_centroids, target_int,
                        update_state, update_state_loop)

__all__ = ["OVQState", "OpenChunk", "OvqKernelOptions", "ovq_attention", "ovq_attention_phased", "ovq_open_attention",
           "phase_open_len", "resolve_backend", "target_int", "chunk_attention_ref",
           "chunk_attention_triton", "exact_causal_attention", "target_centroids", "update_state",
           "update_state_loop"]
