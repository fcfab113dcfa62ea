"""MoBA's decode kernel: one query per head attends to a few ranges of slots of a preallocated K/V buffer (the
`top_k - 1` selected earlier blocks and its own block, `reference.decode_gate`), so a step reads `top_k` blocks of
keys and values per query head instead of the whole cache. `reference.ranges_attention_reference` is its definition.

Kernel 1: one program per (batch row, query head) and per (range, piece): a range is cut into `NSP` pieces (more
programs where batch x heads alone would not fill the GPU); an online softmax in base 2 over its piece, one query
row (elementwise products and sums: a decode step is bound by the bytes it reads), keys masked by validity except
the query's own slot; it writes the unnormalised output and the running max and sum (fp32). Kernel 2 combines the
pieces and writes `[B, 1, Hq, D]` in q's dtype. The ranges are device tensors and the launch depends only on the
shapes, so a step replays from a CUDA graph. The G query heads of a kv head are adjacent programs: the own block,
which they share, is read from L2 after the first of them.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..triton_lib import LOG2E

BN = 64  # keys per tile


@triton.jit(do_not_specialize=["NSP"])
def _ranges_kernel(Q, K, V, KM, ST, EN, SLOT, PO, PM, PL,
                   sqb, sqh, skb, skh, sks, svb, svh, svs, skmb, srb, srh,
                   scale_log2, NSP,
                   HQ: tl.constexpr, G: tl.constexpr, NL: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)  # b * HQ + h
    j = tl.program_id(1)  # range * NSP + piece
    bh = pid.to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = bh // HQ
    h = bh % HQ
    hk = h // G
    r = j // NSP
    piece = j % NSP
    start = tl.load(ST + b * srb + h * srh + r)
    end = tl.load(EN + b * srb + h * srh + r)
    size = tl.maximum(end - start, 0)
    chunk = tl.cdiv(tl.cdiv(size, NSP), BN) * BN
    lo = start + piece * chunk
    hi = tl.minimum(lo + chunk, end)
    own = tl.load(SLOT + b)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + d).to(tl.float32) * scale_log2
    m = tl.max(tl.full([BN], float("-inf"), tl.float32), 0)
    l = tl.sum(tl.zeros([BN], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    kbase = K + b * skb + hk * skh
    vbase = V + b * svb + hk * svh
    for n0 in range(lo, hi, BN):
        cols = n0 + tl.arange(0, BN)
        cv = cols < hi
        kt = tl.load(kbase + cols[:, None] * sks + d[None, :], mask=cv[:, None], other=0.0).to(tl.float32)
        sc = tl.sum(kt * q[None, :], 1)
        km = tl.load(KM + b * skmb + cols, mask=cv, other=0) != 0
        ok = cv & (km | (cols == own))
        sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exponentials of -inf are 0, not NaN
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(sc - m_safe)
        l = l * alpha + tl.sum(p, 0)
        vt = tl.load(vbase + cols[:, None] * svs + d[None, :], mask=cv[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, 0)
        m = m_new
    base = bh * (NL * NSP) + j
    tl.store(PO + base * D + d, acc)
    tl.store(PM + base, m)
    tl.store(PL + base, l)


@triton.jit
def _combine_kernel(PO, PM, PL, O, sob, soh, HQ: tl.constexpr, NJ: tl.constexpr, NJP: tl.constexpr,
                    D: tl.constexpr):
    pid = tl.program_id(0)
    bh = pid.to(tl.int64)
    b = bh // HQ
    h = bh % HQ
    js = tl.arange(0, NJP)
    jv = js < NJ
    d = tl.arange(0, D)
    row = bh * NJ + js
    pm = tl.load(PM + row, mask=jv, other=float("-inf"))
    mx = tl.max(pm, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(pm - mx)
    den = tl.sum(w * tl.load(PL + row, mask=jv, other=0.0), 0)
    acc = tl.sum(w[:, None] * tl.load(PO + row[:, None] * D + d[None, :], mask=jv[:, None], other=0.0), 0)
    tl.store(O + b * sob + h * soh + d, (acc / den).to(O.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pieces(q: torch.Tensor, n_ranges: int, longest: int, splits: int | None = None) -> int:
    """Pieces per range: enough programs for two per SM, no piece under one tile of the `longest` keys a selected
    range holds (a block); `splits` fixes it (tests)."""
    if splits is not None:
        return max(1, int(splits))
    B, Hq = q.shape[0], q.shape[1]
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else 4
    return max(1, min(triton.cdiv(longest, BN), math.ceil(2 * sms / (B * Hq * n_ranges))))


def ranges_attention(q, keys, values, key_mask, starts, ends, slot, *, scale: float, longest: int,
                     splits: int | None = None) -> torch.Tensor:
    """`reference.ranges_attention_reference` on the two kernels: q `[B, Hq, 1, D]`, keys/values `[B, Hkv, cap, D]`,
    key_mask `[B, cap]` bool, starts/ends `[B, Hq, NL]` int32, slot `[B]`; returns `[B, 1, Hq, D]` in q's dtype."""
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    NL = starts.shape[2]
    NSP = pieces(q, NL, longest, splits)
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    km = key_mask if key_mask.dtype != torch.bool else key_mask.view(torch.int8)
    if km.stride(-1) != 1:
        km = km.contiguous()
    starts, ends = starts.contiguous(), ends.contiguous()
    slot = slot.contiguous()
    NJ = NL * NSP
    dev = q.device
    po = torch.empty(B * Hq * NJ * D, device=dev, dtype=torch.float32)
    pm = torch.empty(B * Hq * NJ, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    _ranges_kernel[(B * Hq, NJ)](
        q, keys, values, km, starts, ends, slot, po, pm, pl,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), km.stride(0), starts.stride(0), starts.stride(1),
        scale * LOG2E, NSP,
        HQ=Hq, G=Hq // Hkv, NL=NL, BN=BN, D=D, num_warps=4, num_stages=2)
    out = torch.empty(B, 1, Hq, D, device=dev, dtype=q.dtype)
    _combine_kernel[(B * Hq,)](po, pm, pl, out, out.stride(0), out.stride(2),
                               HQ=Hq, NJ=NJ, NJP=triton.next_power_of_2(NJ), D=D, num_warps=4)
    return out


__all__ = ["BN", "pieces", "ranges_attention"]
