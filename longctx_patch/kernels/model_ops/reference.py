"""The model's own small ops as transformers' eager modeling code computes them (llama, mistral, qwen2, qwen3): the
definitions the kernels of `triton_model_ops.py` round like and must equal (tests/test_fused_ops.py checks these
against transformers' own functions and modules, and the kernels against both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`cat(-x2, x1)` of the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim=1): q, k `[B, H, S, D]`, cos/sin `[B or 1, S, D]`; each
    product rounded to the dtype, then the sum."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward: `weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype)`."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The SiLU MLP's `act_fn(gate_proj(x)) * up_proj(x)` after its two GEMMs: `F.silu(g) * u`."""
    return F.silu(g) * u


__all__ = ["rms_norm_reference", "rotary_reference", "rotate_half", "silu_mul_reference"]
