"""Fused replacements for the model's own small elementwise ops at inference: the rotary embedding of q and k, RMSNorm,
and SiLU(gate) * up, each one Triton launch (`triton_model_ops.py`) where transformers' eager code issues several.

`mode` (the patch's `fused_ops`, see longctx_patch/fused_ops.py): "auto" takes a kernel for CUDA tensors only;
"triton" also for CPU tensors under TRITON_INTERPRET=1 (tests). A `*_missing` function says why a call takes the
original PyTorch ops instead (None: the kernel can run): Triton or the device missing, a dtype or shape the kernel
does not take, or a gradient to compute (the kernels have no backward). The kernels round as the original code rounds
(`triton_model_ops.py`), so the two paths agree to the last bit up to the order of a sum (RMSNorm's mean) and the
exponential's implementation (SiLU).
"""

from __future__ import annotations

import torch

from ..backend import needs_grad, triton_missing

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_NORM_DIM = 32768  # RMSNorm rows wider than this take the original ops (one row is one program's tile)


def _device_missing(mode: str, *tensors: torch.Tensor) -> str | None:
    if mode == "auto" and not all(t.is_cuda for t in tensors):
        return "not CUDA tensors"
    return triton_missing(*tensors)


def _compiling() -> bool:
    # under torch.compile the compiler fuses these ops itself
    return torch.compiler.is_compiling()


def rotary_missing(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> str | None:
    """None when `rotary` can replace `apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim=1) here, else why not."""
    if _compiling():
        return "under torch.compile"
    if needs_grad(q, k, cos, sin):
        return "a gradient is needed"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or sin.stride() != cos.stride():
        return "shapes: q/k [B, H, S, D], cos/sin [B, S, D] alike"
    B, _, S, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (S, D) or cos.shape[1:] != (S, D) or cos.shape[0] not in (1, B):
        return f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} (rotary on the full head dim)"
    if D % 2 or q.stride(3) != 1 or k.stride(3) != 1 or cos.stride(2) != 1:
        return "an odd head dim, or a last dimension that is not contiguous"
    if q.dtype not in _DTYPES or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return f"dtypes {q.dtype}/{k.dtype}/{cos.dtype}/{sin.dtype}: fp16, bf16 or fp32, all alike"
    return _device_missing(mode, q, k, cos, sin)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (rotate-half, cos/sin on the full head dim) in one
    launch for q and k; new contiguous tensors. Call after `rotary_missing` said None."""
    from .triton_model_ops import rotary as launch

    return launch(q, k, cos, sin)


def rms_norm_missing(x: torch.Tensor, weight: torch.Tensor, mode: str) -> str | None:
    """None when `rms_norm` can replace LlamaRMSNorm's forward on x here, else why not."""
    if _compiling():
        return "under torch.compile"
    if needs_grad(x, weight):
        return "a gradient is needed"
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0] or not weight.is_contiguous():
        return "weight [N] contiguous, x [..., N]"
    if x.shape[-1] > MAX_NORM_DIM or x.stride(-1) != 1:
        return f"rows of more than {MAX_NORM_DIM}, or not contiguous"
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return f"dtypes {x.dtype}/{weight.dtype}: fp16, bf16 or fp32"
    return _device_missing(mode, x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)` in one launch."""
    from .triton_model_ops import rms_norm as launch

    return launch(x, weight, eps)


def silu_mul_missing(g: torch.Tensor, u: torch.Tensor, mode: str) -> str | None:
    """None when `silu_mul` can replace `F.silu(g) * u` here, else why not."""
    if _compiling():
        return "under torch.compile"
    if needs_grad(g, u):
        return "a gradient is needed"
    if g.shape != u.shape or g.dtype != u.dtype or g.dtype not in _DTYPES:
        return "g and u of one shape and dtype (fp16, bf16 or fp32)"
    if not (g.is_contiguous() and u.is_contiguous()):
        return "not contiguous"
    return _device_missing(mode, g, u)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`F.silu(g) * u` in one launch."""
    from .triton_model_ops import silu_mul as launch

    return launch(g, u)
