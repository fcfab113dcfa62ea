"""The Triton forward kernel of exact sliding-window causal attention (`window.window_attention_triton`), O(S * W).

Layout: one program per (block of BR stacked rows, batch x kv head). The G query heads of a kv head and the Sq
queries are stacked into R = Sq * G rows, position-major (row r = i * G + g: query i, head g of the group), so a
block of rows covers BR / G consecutive query positions for any G (7 included) with no padding but the last
block's tail, and each key tile is loaded once for the G heads. The program loops only over the key tiles of its
band: from `max(0, first position - W + 1)` (aligned down to BN) to its last position; each tile goes into an
online softmax in base 2 (the scale times log2(e) folded into one product of the logits), with the mask of
`softmax.attention_mask`: query i at key position `q_off + i` sees keys in `(pos - W, pos]` that `key_mask`
marks real, and always its own key (so no row ends empty). Output `[B, Sq, Hq, D]` in q's dtype: the rows of a
block at one position are G adjacent heads, contiguous in that layout.

Forward only (inference prefill): the banded SDPA path (`window.banded_window_attention`) keeps the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import LOG2E, dot, online_softmax_step
from .options import WindowTiles


# lengths, offsets and the window change from call to call: not specialised, one compiled kernel serves them all
@triton.jit(do_not_specialize=["skmb", "Sq", "q_off", "window"])
def _window_fwd_kernel(Q, K, V, KM, O,
                       sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, skmb, sob, sos, soh,
                       Sq, q_off, window, scale_log2,
                       HKV: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                       HAS_KM: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    rb = tl.program_id(0)  # block of stacked rows (32-bit: row and key positions of the hot loop stay 32-bit)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    h = bh % HKV
    b = bh // HKV
    R = Sq * G
    r0 = rb * BR
    rows = r0 + tl.arange(0, BR)
    rvalid = rows < R
    i = rows // G
    g = rows % G
    qpos = q_off + i
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + (h * G + g)[:, None] * sqh + i[:, None] * sqs + d[None, :],
                mask=rvalid[:, None], other=0.0)
    # the band of the block: keys (first - W, last]
    first = q_off + r0 // G
    last = q_off + (tl.minimum(r0 + BR, R) - 1) // G
    lo = tl.maximum(first - window + 1, 0)
    lo = (lo // BN) * BN
    hi = last + 1
    m = tl.full([BR], float("-inf"), tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    kbase = K + b * skb + h * skh
    vbase = V + b * svb + h * svh
    for n0 in range(lo, hi, BN):
        cols = n0 + tl.arange(0, BN)
        cvalid = cols < hi
        kt = tl.load(kbase + cols[:, None] * sks + d[None, :], mask=cvalid[:, None], other=0.0)
        sc = dot(q, tl.trans(kt), PREC, UP) * scale_log2
        ok = (cols[None, :] <= qpos[:, None]) & (cols[None, :] > qpos[:, None] - window)
        if HAS_KM:
            km = tl.load(KM + b * skmb + cols, mask=cvalid, other=0) != 0
            ok = (ok & km[None, :]) | (cols[None, :] == qpos[:, None])
        sc = tl.where(ok, sc, float("-inf"))
        m, p, alpha = online_softmax_step(sc, m, True, True)  # EMPTY: a row's first tiles may hold none of its keys
        l = l * alpha + tl.sum(p, 1)
        vt = tl.load(vbase + cols[:, None] * svs + d[None, :], mask=cvalid[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, PREC, UP)
    l = tl.where(l == 0.0, 1.0, l)  # only the padding rows past R (never stored)
    out = acc / l[:, None]
    tl.store(O + b * sob + i[:, None] * sos + (h * G + g)[:, None] * soh + d[None, :],
             out.to(O.dtype.element_ty), mask=rvalid[:, None])


def window_tiles(D: int, dtype: torch.dtype, tiles: WindowTiles | None = None) -> tuple[int, int, int, int]:
    """(rows per program BR, keys per tile BN, warps, stages) for head dim D: those `tiles` gives, the defaults for
    the others (picked for H100/H200 without a GPU run yet, to tune)."""
    if dtype == torch.float32:
        BR, BN = (64, 64) if D <= 64 else (64, 32)
    elif D <= 128:
        BR, BN = 128, 64
    else:
        BR, BN = 64, 32
    warps = 4 if D <= 64 and dtype != torch.float32 else 8
    stages = 2
    t = tiles or WindowTiles()
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return pick(t.block_rows, BR), pick(t.block_keys, BN), pick(t.warps, warps), pick(t.stages, stages)


def window_forward(q, k, v, *, scale, window, key_mask, q_offset, tiles: WindowTiles | None = None):
    """`window.window_attention_triton` after its checks: q `[B, Hq, Sq, D]`, k/v `[B, Hkv, Sk, D]`, key_mask
    `[B, Sk]` or None, `tiles` the launch tiles (`window_tiles`); returns `[B, Sq, Hq, D]` in q's dtype."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q_off = Sk - Sq if q_offset is None else int(q_offset)
    W = min(int(window), Sk)  # a window past every key is the full causal mask (and stays 32-bit)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    BR, BN, warps, stages = window_tiles(D, q.dtype, tiles)
    out = torch.empty(B, Sq, Hq, D, device=q.device, dtype=q.dtype)
    if B * Sq * Hq == 0:
        return out
    km = key_mask
    if km is not None:
        km = km.to(device=q.device, dtype=torch.int8)
        if km.stride(-1) != 1:
            km = km.contiguous()
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(Sq * G, BR), B * Hkv)
    _window_fwd_kernel[grid](
        q, k, v, km if km is not None else q, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), km.stride(0) if km is not None else 0,
        out.stride(0), out.stride(1), out.stride(2),
        Sq, q_off, W, scale * LOG2E,
        HKV=Hkv, G=G, BR=BR, BN=BN, D=D, HAS_KM=km is not None, PREC=prec, UP=INTERPRET,
        num_warps=warps, num_stages=stages)
    return out
