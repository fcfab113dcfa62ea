"""The model's own small ops (rotary embedding of q and k, RMSNorm, SiLU(gate) * up) as single Triton launches at
inference: `reference` (the ops as transformers' eager code computes them), `ops` (each kernel's entry point and its
`*_missing` check), `triton_model_ops` (the kernels). fused_ops.py installs them on a patched model
(`patch(..., fused_ops=...)`)."""

from .ops import rms_norm, rms_norm_missing, rotary, rotary_missing, silu_mul, silu_mul_missing
from .reference import rms_norm_reference, rotary_reference, silu_mul_reference

__all__ = ["rms_norm", "rms_norm_missing", "rms_norm_reference", "rotary", "rotary_missing", "rotary_reference",
           "silu_mul", "silu_mul_missing", "silu_mul_reference"]
