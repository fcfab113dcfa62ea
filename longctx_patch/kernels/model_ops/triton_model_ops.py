"""The Triton kernels of `ops.py` (their definitions: `reference.py`): rotary embedding of q and k in one launch,
RMSNorm, SiLU(gate) * up.

Each one replaces a chain of PyTorch elementwise kernels of the model's own code (transformers' llama / mistral /
qwen2 / qwen3 modeling) and rounds where that code rounds: every intermediate the original holds in the input dtype
(bf16, fp16) is rounded to it here too, every fp32 intermediate stays fp32.

- `_rotary_kernel`: `q * cos + rotate_half(q) * sin` and the same for k (`apply_rotary_pos_emb`): each product
  rounded to the dtype, then the sum. fp32: no fused multiply-add (`enable_fp_fusion=False`), as PyTorch's two
  multiplies and an add. One program per (batch row, position) and block of heads; q's head blocks first, then
  k's. Writes contiguous `[B, H, S, D]`.
- `_rmsnorm_kernel`: one row per program: `weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype)` (LlamaRMSNorm);
  the product in fp32, rounded to the output dtype (the promotion of weight's and x's dtypes).
- `_silu_mul_kernel`: `silu(g) * u`, silu in fp32 rounded to the dtype (F.silu), then the product rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET, next_power_of_2
from ..triton_lib import rounded


@triton.jit
def _rotary_rows(X, O, C, SN, b, s, h0, H, S, sxb, sxh, sxs, scb, scs,
                 HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, EMU: tl.constexpr):
    """Heads h0 .. h0 + BH - 1 (< H) of X at (b, s) into O (contiguous [B, H, S, 2 * HALF])."""
    h = h0 + tl.arange(0, BH)
    d = tl.arange(0, BD)
    dm = d < HALF
    m = (h < H)[:, None] & dm[None, :]
    c_at = C + b * scb + s * scs
    s_at = SN + b * scb + s * scs
    c1 = tl.load(c_at + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_at + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_at + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_at + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    x_at = X + b * sxb + s * sxs + h[:, None] * sxh + d[None, :]
    x1 = tl.load(x_at, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF, mask=m, other=0.0).to(tl.float32)
    dt = O.dtype.element_ty
    # rotate_half(x) = cat(-x2, x1): first half x1 * c1 + (-x2) * s1, second half x2 * c2 + x1 * s2
    o1 = rounded(rounded(x1 * c1, dt, EMU) + rounded(-x2 * s1, dt, EMU), dt, EMU).to(dt)
    o2 = rounded(rounded(x2 * c2, dt, EMU) + rounded(x1 * s2, dt, EMU), dt, EMU).to(dt)
    D = 2 * HALF
    o_at = O + ((b * H + h[:, None]) * S + s) * D + d[None, :]
    tl.store(o_at, o1, mask=m)
    tl.store(o_at + HALF, o2, mask=m)


@triton.jit
def _rotary_kernel(Q, K, QO, KO, C, SN, S, HQ, HK,
                   sqb, sqh, sqs, skb, skh, sks, scb, scs,
                   HALF: tl.constexpr, BHQ: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr,
                   NQB: tl.constexpr, EMU: tl.constexpr):
    bs = tl.program_id(0).to(tl.int64)  # 64-bit offsets: B * S * H * D may pass 2**31
    j = tl.program_id(1)
    b = bs // S
    s = bs % S
    if j < NQB:
        _rotary_rows(Q, QO, C, SN, b, s, j * BHQ, HQ, S, sqb, sqh, sqs, scb, scs, HALF, BHQ, BD, EMU)
    else:
        _rotary_rows(K, KO, C, SN, b, s, (j - NQB) * BHK, HK, S, skb, skh, sks, scb, scs, HALF, BHK, BD, EMU)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, Hq, S, D], k [B, Hk, S, D] (any strides, last one 1), cos/sin [B or 1, S, D] (last stride 1, same
    strides): new contiguous q, k rotated. The caller checked the shapes and dtypes (`fused.rotary_missing`)."""
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    half = D // 2
    qo = torch.empty((B, HQ, S, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, HK, S, D), dtype=k.dtype, device=k.device)
    if qo.numel() == 0 or ko.numel() == 0:
        return qo, ko
    scb = cos.stride(0) if cos.shape[0] == B and B > 1 else 0
    bd = next_power_of_2(half)
    cap = max(1, 2048 // bd)  # a tile of about 2048 elements per half
    bhq, bhk = min(next_power_of_2(HQ), cap), min(next_power_of_2(HK), cap)
    nqb, nkb = triton.cdiv(HQ, bhq), triton.cdiv(HK, bhk)
    _rotary_kernel[(B * S, nqb + nkb)](
        q, k, qo, ko, cos, sin, S, HQ, HK,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), scb, cos.stride(1),
        HALF=half, BHQ=bhq, BHK=bhk, BD=bd, NQB=nqb, EMU=INTERPRET, enable_fp_fusion=False)
    return qo, ko


@triton.jit
def _rmsnorm_kernel(X, W, O, sx, N, eps, BN: tl.constexpr, EMU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BN)
    m = n < N
    x = tl.load(X + row * sx + n, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    h = rounded(x * tl.math.rsqrt(var + eps), X.dtype.element_ty, EMU)
    w = tl.load(W + n, mask=m, other=0.0).to(tl.float32)
    dt = O.dtype.element_ty
    tl.store(O + row * N + n, rounded(w * h, dt, EMU).to(dt), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (last stride 1), weight [N] contiguous: the output of LlamaRMSNorm, contiguous, in the promotion of
    weight's and x's dtypes."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows = x2.shape[0]
    if rows == 0:
        return out
    bn = next_power_of_2(N)
    warps = 1 if bn <= 512 else 4 if bn <= 4096 else 8 if bn <= 8192 else 16
    _rmsnorm_kernel[(rows,)](x2, weight, out, x2.stride(0), N, float(eps), BN=bn, EMU=INTERPRET, num_warps=warps)
    return out


@triton.jit
def _silu_mul_kernel(G, U, O, n, BLOCK: tl.constexpr, EMU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    dt = O.dtype.element_ty
    a = rounded(g / (1.0 + tl.exp(-g)), dt, EMU)
    tl.store(O + offs, rounded(a * u, dt, EMU).to(dt), mask=m)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for contiguous g, u of one shape and dtype."""
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        _silu_mul_kernel[(triton.cdiv(n, block),)](g, u, out, n, BLOCK=block, EMU=INTERPRET, num_warps=4)
    return out
