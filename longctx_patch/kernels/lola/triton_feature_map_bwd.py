"""Backward of the hedgehog feature map phi(x) = [max(softmax(a), eps), max(softmax(-a), eps)], a = x W per head
(the forward is `triton_hybrid.feature_map`; the autograd.Function is `ops.FeatureMapFn`).

With s+ = softmax(a), s- = softmax(-a) and g+ / g- the incoming gradient of each half (zero where the clamp held,
s < eps, as torch's clamp_min passes it only where s >= eps):

    da = s+ * (g+ - sum_f g+ s+) - s- * (g- - sum_f g- s-)
    dx = da W^T        (per query head; kv-head inputs sum over their group outside)
    dW = sum_rows x^T da

One program takes RPP rows of one (batch, head) in tiles of BM: it recomputes a with the forward's product (same
precision), writes dx of its rows and one partial dW (summed over programs outside, so the result does not depend
on the order programs run in). For a bf16 / fp16 x the products of dx and dW take da and W in that dtype (tensor
cores, fp32 sums: what autocast's backward of the PyTorch map does); for fp32 x they are fp32, as the forward.
`NEED_DX` / `NEED_DW`: constexpr switches for the stage that trains only the feature maps (no dx) or only the
projections below them (no dW).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import cast_out, dot, dot_precision, np2
from .triton_hybrid import fmap_precision
from .tuning import DEFAULT_TUNING, LolaTuning


@triton.jit
def _feature_map_bwd_kernel(
    X, W, DO, DX, DWP,
    N, D, F, G, eps, RPP,
    s_x_b, s_x_h, s_x_n,
    s_w_h, s_w_d,
    s_do_b, s_do_h, s_do_n,
    s_dx_b, s_dx_h, s_dx_n,
    s_p_b, s_p_m, s_p_h, s_p_d,
    H: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr, GPREC: tl.constexpr,
    LOWP: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // H
    h = pid_bh % H
    hx = h // G
    offs_d = tl.arange(0, BD)
    offs_f = tl.arange(0, BF)
    md = offs_d < D
    mf = offs_f < F
    w = tl.load(W + h * s_w_h + offs_d[:, None] * s_w_d + offs_f[None, :], mask=md[:, None] & mf[None, :], other=0.0)
    if LOWP:
        w_t = tl.trans(w).to(X.dtype.element_ty)
    else:
        w_t = tl.trans(w.to(tl.float32))
    dw = tl.zeros((BD, BF), dtype=tl.float32)
    start = pid_m * RPP
    for r0 in range(start, tl.minimum(start + RPP, N), BM):
        offs_m = r0 + tl.arange(0, BM)
        mm = offs_m < N
        x = tl.load(X + b * s_x_b + hx * s_x_h + offs_m[:, None] * s_x_n + offs_d[None, :],
                    mask=mm[:, None] & md[None, :], other=0.0)
        a = dot(x.to(w.dtype), w, PREC, UPCAST)  # [BM, BF] fp32, as the forward computed it
        ap = tl.where(mf[None, :], a, float("-inf"))
        an = tl.where(mf[None, :], -a, float("-inf"))
        sp = tl.exp(ap - tl.max(ap, 1)[:, None])
        sn = tl.exp(an - tl.max(an, 1)[:, None])
        sp = sp / tl.sum(sp, 1)[:, None]
        sn = sn / tl.sum(sn, 1)[:, None]
        msk = mm[:, None] & mf[None, :]
        base = DO + b * s_do_b + h * s_do_h + offs_m[:, None] * s_do_n
        gp = tl.load(base + offs_f[None, :], mask=msk, other=0.0).to(tl.float32)
        gn = tl.load(base + F + offs_f[None, :], mask=msk, other=0.0).to(tl.float32)
        gp = tl.where(sp >= eps, gp, 0.0)
        gn = tl.where(sn >= eps, gn, 0.0)
        da = sp * (gp - tl.sum(gp * sp, 1)[:, None]) - sn * (gn - tl.sum(gn * sn, 1)[:, None])
        da = tl.where(msk, da, 0.0)
        if LOWP:  # bf16 / fp16 input: the gradient products on tensor cores in its dtype, fp32 sums
            da_g = da.to(X.dtype.element_ty)
            x_g = x
        else:
            da_g = da
            x_g = x.to(tl.float32)
        if NEED_DX:
            dx = dot(da_g, w_t, GPREC, UPCAST)  # [BM, BD]
            tl.store(DX + b * s_dx_b + h * s_dx_h + offs_m[:, None] * s_dx_n + offs_d[None, :],
                     cast_out(dx, DX, UPCAST), mask=mm[:, None] & md[None, :])
        if NEED_DW:
            dw = dot(tl.trans(x_g), da_g, GPREC, UPCAST) + dw
    if NEED_DW:
        base_p = DWP + b * s_p_b + pid_m.to(tl.int64) * s_p_m + h * s_p_h
        tl.store(base_p + offs_d[:, None] * s_p_d + offs_f[None, :], dw, mask=md[:, None] & mf[None, :])


def feature_map_bwd(x, weight, dphi, eps: float, need_dx: bool, need_dw: bool, rows_per_program: int | None = None,
                    tuning: LolaTuning = DEFAULT_TUNING):
    """Gradients of `feature_map(x, weight, eps)` for the incoming `dphi` [B, H, N, 2F]: (dx [B, Hx, N, D] in
    x.dtype or None, dW [H, D, F] fp32 or None). x [B, Hx, N, D] with a unit last stride, weight [H, D, F]. tuning: the
    projection's precision, as the forward's (`fmap_prec`)."""
    B, Hx, N, D = x.shape
    H, _, F = weight.shape
    G = H // Hx
    w = weight.contiguous()
    dphi = dphi if dphi.stride(-1) == 1 else dphi.contiguous()
    BM = max(16, min(64, np2(N)))
    # rows per program: enough programs to fill the GPU at training shapes, few partial dW to sum
    rpp = rows_per_program or max(BM, min(1024, np2(triton.cdiv(N * B * H, 2048), BM)))
    rpp = triton.cdiv(rpp, BM) * BM
    nprog = triton.cdiv(N, rpp)
    dx = None
    if need_dx:  # per query head; a kv-head input sums its group below (fp32 then)
        dx = torch.empty(B, H, N, D, device=x.device, dtype=x.dtype if G == 1 else torch.float32)
    parts = torch.empty(B, nprog, H, D, F, device=x.device, dtype=torch.float32) if need_dw else None
    dxa = dx if dx is not None else x  # unused pointers when a switch is off
    pa = parts if parts is not None else w
    lowp = x.dtype in (torch.bfloat16, torch.float16)
    grid = (nprog, B * H)
    _feature_map_bwd_kernel[grid](
        x, w, dphi, dxa, pa,
        N, D, F, G, eps, rpp,
        x.stride(0), x.stride(1), x.stride(2),
        w.stride(0), w.stride(1),
        dphi.stride(0), dphi.stride(1), dphi.stride(2),
        dxa.stride(0), dxa.stride(1), dxa.stride(2),
        *((parts.stride(0), parts.stride(1), parts.stride(2), parts.stride(3)) if parts is not None else (0, 0, 0, 0)),
        H=H, BM=BM, BD=np2(D), BF=np2(F), PREC=fmap_precision(w, tuning), GPREC=dot_precision(x, w), LOWP=lowp,
        NEED_DX=need_dx, NEED_DW=need_dw, num_warps=8,
    )
    if dx is not None and G > 1:
        dx = dx.view(B, Hx, G, N, D).sum(2).to(x.dtype)
    dw = parts.sum((0, 1)) if parts is not None else None
    return dx, dw
