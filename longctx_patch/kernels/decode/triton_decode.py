"""The split-key Triton kernels of `ops.masked_few_query_attention` ("flash-decoding"), their tiles and launch.

Layout: the G query heads of a kv head and the Sq queries are stacked into R = G * Sq rows, so each kv head's keys
are read once for all of them. Kernel 1: one program per (batch row, kv head, block of BR rows) and per split of
the keys; an online softmax in base 2 over its split; it writes the unnormalised output and the running max and
sum (fp32). Kernel 2 combines the splits and writes `[B, Sq, Hq, D]` in q's dtype. The mask is the one of
`attention_mask`: query i sits at key `q_offset + i`, sees keys `<= ` its position (and `> position - window`),
only real keys (`key_mask`), and always its own key.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import LOG2E, combine_splits, dot, online_softmax_step


# the cache length and what follows from it change at every decode step: not specialised, so one compiled
# kernel serves every step (k/v strides stay specialised: multiples of 16 for head_dim >= 16)
@triton.jit(do_not_specialize=["skmb", "Sk", "q_off", "window", "NS"])
def _split_kernel(Q, K, V, KM, POS, PO, PM, PL,
                  sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, skmb, spb, sph,
                  Sk, Sq, q_off, window, scale_log2, chunk, NS,
                  HKV: tl.constexpr, G: tl.constexpr, NRB: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                  D: tl.constexpr, HAS_KM: tl.constexpr, HAS_WIN: tl.constexpr, HAS_POS: tl.constexpr,
                  PREC: tl.constexpr, UP: tl.constexpr):
    pid = tl.program_id(0)  # ((b * HKV + h) * NRB + rb)
    s = tl.program_id(1)  # split of the keys
    rb = pid % NRB  # 32-bit: the row and key positions of the hot loop stay 32-bit
    bh = (pid // NRB).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    h = bh % HKV
    b = bh // HKV
    rows = rb * BR + tl.arange(0, BR)  # stacked rows: r = g * Sq + i
    rvalid = rows < G * Sq
    g = rows // Sq
    i = rows % Sq
    if HAS_POS:  # each row's own key position (the rows a MuSe guard samples), else the last Sq keys
        qpos = tl.load(POS + b * spb + (h * G + g) * sph + i, mask=rvalid, other=0).to(tl.int32)
    else:
        qpos = q_off + i
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + (h * G + g)[:, None] * sqh + i[:, None] * sqs + d[None, :],
                mask=rvalid[:, None], other=0.0)
    start = s * chunk
    end = tl.minimum(start + chunk, Sk)
    m = tl.full([BR], float("-inf"), tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    kbase = K + b * skb + h * skh
    vbase = V + b * svb + h * svh
    for n0 in range(start, end, BN):
        cols = n0 + tl.arange(0, BN)
        cvalid = cols < end
        kt = tl.load(kbase + cols[:, None] * sks + d[None, :], mask=cvalid[:, None], other=0.0)
        sc = dot(q, tl.trans(kt), PREC, UP) * scale_log2
        ok = cols[None, :] <= qpos[:, None]
        if HAS_WIN:
            ok = ok & (cols[None, :] > qpos[:, None] - window)
        if HAS_KM:
            km = tl.load(KM + b * skmb + cols, mask=cvalid, other=0) != 0
            ok = (ok & km[None, :]) | (cols[None, :] == qpos[:, None])
        ok = ok & cvalid[None, :]
        sc = tl.where(ok, sc, float("-inf"))
        m, p, alpha = online_softmax_step(sc, m, True, True)  # EMPTY: a row may have no key yet in this split
        l = l * alpha + tl.sum(p, 1)
        vt = tl.load(vbase + cols[:, None] * svs + d[None, :], mask=cvalid[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, PREC, UP)
    r = tl.arange(0, BR)
    base = pid.to(tl.int64) * NS + s
    tl.store(PO + (base * BR + r)[:, None] * D + d[None, :], acc)
    tl.store(PM + base * BR + r, m)
    tl.store(PL + base * BR + r, l)

@triton.jit(do_not_specialize=["NS"])
def _combine_kernel(PO, PM, PL, O, sob, sos, soh, Sq, NS,
                    HKV: tl.constexpr, G: tl.constexpr, NRB: tl.constexpr, BR: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    rb = pid % NRB
    bh = (pid // NRB).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    h = bh % HKV
    b = bh // HKV
    r = tl.arange(0, BR)
    d = tl.arange(0, D)
    acc, den = combine_splits(PO, PM, PL, pid.to(tl.int64) * NS, 1, BR, r, r, NS, D, BR, False)
    rows = rb * BR + r
    rvalid = rows < G * Sq
    g = rows // Sq
    i = rows % Sq
    den = tl.where(rvalid, den, 1.0)
    out = acc / den[:, None]
    tl.store(O + b * sob + i[:, None] * sos + (h * G + g)[:, None] * soh + d[None, :],
             out.to(O.dtype.element_ty), mask=rvalid[:, None])


def decode_tiles(D: int, R: int) -> tuple[int, int, int]:
    """(rows per program BR, keys per tile BN, warps)."""
    BR = min(64, max(16, triton.next_power_of_2(R)))
    BN = 64 if D >= 128 or BR >= 64 else 128
    return BR, BN, 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_attention(q, k, v, *, scale, key_mask, q_offset, window, splits, positions=None):
    """`ops.launch_masked_few_query`: the two kernels."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q_off = Sk - Sq if q_offset is None else int(q_offset)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    R = G * Sq
    BR, BN, warps = decode_tiles(D, R)
    NRB = triton.cdiv(R, BR)
    progs = B * Hkv * NRB
    if splits is None:
        sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
            if q.is_cuda else 4
        splits = max(1, min(triton.cdiv(Sk, BN), math.ceil(2 * sms / progs)))
    chunk = triton.cdiv(triton.cdiv(Sk, splits), BN) * BN
    NS = triton.cdiv(Sk, chunk)
    dev = q.device
    po = torch.empty(progs * NS * BR * D, device=dev, dtype=torch.float32)
    pm = torch.empty(progs * NS * BR, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    km = key_mask
    if km is not None:
        km = km.to(device=dev, dtype=torch.int8)
        if km.stride(-1) != 1:
            km = km.contiguous()
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    pos = positions
    if pos is not None and pos.stride(-1) != 1:
        pos = pos.contiguous()
    _split_kernel[(progs, NS)](
        q, k, v, km if km is not None else q, pos if pos is not None else q, po, pm, pl,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), km.stride(0) if km is not None else 0,
        pos.stride(0) if pos is not None else 0, pos.stride(1) if pos is not None else 0,
        Sk, Sq, q_off, window if window is not None else 0, scale * LOG2E, chunk, NS,
        HKV=Hkv, G=G, NRB=NRB, BR=BR, BN=BN, D=D, HAS_KM=km is not None, HAS_WIN=window is not None,
        HAS_POS=pos is not None, PREC=prec, UP=INTERPRET,
        num_warps=warps, num_stages=2)
    out = torch.empty(B, Sq, Hq, D, device=dev, dtype=q.dtype)
    _combine_kernel[(progs,)](po, pm, pl, out, out.stride(0), out.stride(1), out.stride(2), Sq, NS,
                              HKV=Hkv, G=G, NRB=NRB, BR=BR, D=D, num_warps=4)
    return out
