"""MoBA's decode kernels over a preallocated K/V buffer whose block state is kept incrementally
(`reference_decode.py` is their definition): a step is four launches, so that a replayed step costs little beyond
the bytes it reads.

- `_store_kernel` (`store_step`): one program per batch row stores the token's key and value at the write slot,
  marks the slot, adds the key to its block's sum, marks a block's first slot, moves the real count and the slot on
  (`reference_decode.store_step_reference`);
- `_gate_kernel` (`gate_ranges`): one program per (batch row, query head) forms the gate (the block's mean query so
  far, updating the query sum; or the query), scores the complete earlier blocks against their mean keys and picks
  the `top_k - 1` best (pass after pass: the best below the previous pick in the order (score down, block up)),
  and writes the slot ranges (`reference_decode.decode_gate`);
- `_ranges_kernel` and `_combine_kernel` (`ranges_attention`): one query per head attends to its ranges only, so a
  step reads `top_k` blocks of keys and values per query head instead of the whole cache
  (`reference_decode.ranges_attention_reference`). One program per (batch row, query head) and per (range,
  piece): a range is cut into `NSP` pieces where batch x heads alone would not fill the GPU; an online softmax in
  base 2 over its piece, one query row (elementwise products and sums: a decode step is bound by the bytes it
  reads), keys masked by validity except the query's own slot; the combine merges the pieces. The G query heads of
  a kv head are adjacent programs: the own block they share is read from L2 after the first of them.

Every launch is sized by the shapes only and reads its positions from device tensors: a step replays from a CUDA
graph.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..triton_lib import LOG2E

BN = 64  # keys per tile
# blocks per tile of the gate's scan: one width for every block count (a width that followed the count, as it once
# did below 64 blocks, compiled another gate kernel at the first step of a longer context than any before it, e.g.
# ~0.4 s inside the first decode steps of a 32k call after a 1k one)
GATE_TILE = 64


# the block count grows with the buffer: not specialised (a regrown buffer whose count is a multiple of 16 would
# otherwise compile another kernel on its first step)
@triton.jit(do_not_specialize=["sbsb"])
def _store_kernel(K, V, KB, VB, MASK, POS, KS, BST, NR, REAL, SLOT,
                  skb, skh, svb, svh, sbb, sbh, sbs, svbb, svbh, svbs, smb, sksb, sksh, sksn, sbsb, bsize,
                  HKV: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, HAS_REAL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + b)
    nr = tl.load(NR + b)
    if HAS_REAL:
        real = tl.load(REAL + b) != 0
    else:
        real = pos >= 0  # all real
    h = tl.arange(0, HP)
    hv = (h < HKV)[:, None]
    d = tl.arange(0, D)
    kt = tl.load(K + b * skb + h[:, None] * skh + d[None, :], mask=hv, other=0.0)
    vt = tl.load(V + b * svb + h[:, None] * svh + d[None, :], mask=hv, other=0.0)
    tl.store(KB + b * sbb + h[:, None] * sbh + pos * sbs + d[None, :], kt, mask=hv)
    tl.store(VB + b * svbb + h[:, None] * svbh + pos * svbs + d[None, :], vt, mask=hv)
    tl.store(MASK + b * smb + pos, real.to(tl.int8))
    blk = nr // bsize
    at = KS + b * sksb + h[:, None] * sksh + blk * sksn + d[None, :]
    tl.store(at, tl.load(at, mask=hv, other=0.0) + tl.where(real, kt.to(tl.float32), 0.0), mask=hv)
    tl.store(BST + b * sbsb + blk, pos, mask=real & (nr % bsize == 0))
    tl.store(NR + b, nr + real.to(nr.dtype))
    tl.store(SLOT + b, pos)
    tl.store(POS + b, pos + 1)


@triton.jit(do_not_specialize=["sbsb", "nb"])
def _gate_kernel(Q, QS, KS, BST, NR, REAL, SLOT, ST, EN,
                 sqb, sqh, sksb, sksh, sksn, sbsb, nb, bsize, min_seq_len,
                 HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KSEL: tl.constexpr, NL: tl.constexpr,
                 BT: tl.constexpr, BLOCK_GATING: tl.constexpr, HAS_QS: tl.constexpr, HAS_REAL: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # b * HQ + h
    b = bh // HQ
    h = bh % HQ
    hk = h // G
    nr = tl.load(NR + b)
    slot = tl.load(SLOT + b)
    if HAS_REAL:
        real = tl.load(REAL + b) != 0
    else:
        real = slot >= 0  # all real
    qpos = tl.maximum(nr - 1, 0)
    own = qpos // bsize
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + d).to(tl.float32)
    if BLOCK_GATING:
        g = q
        if HAS_QS:
            qs = tl.load(QS + bh * D + d)
            g = qs + q
            done = (qpos + 1) % bsize == 0
            tl.store(QS + bh * D + d, tl.where(real, tl.where(done, 0.0, g), qs))
        g = g / (qpos % bsize + 1).to(tl.float32)
        everything = own * bsize < min_seq_len
    else:
        g = q
        everything = qpos < min_seq_len
    everything = everything | (own <= KSEL)  # at most top_k - 1 earlier blocks: all of them
    first = tl.load(BST + b * sbsb)
    own_start = tl.where(everything, first, tl.load(BST + b * sbsb + own))
    own_start = tl.where(real, own_start, slot)
    out = bh * NL
    tl.store(ST + out + NL - 1, own_start.to(tl.int32))
    tl.store(EN + out + NL - 1, (slot + 1).to(tl.int32))
    if KSEL > 0:
        ks = KS + b * sksb + hk * sksh
        drop = everything | (real == 0)
        prev_s = tl.max(tl.full([BT], float("inf"), tl.float32), 0)
        prev_n = tl.max(tl.full([BT], -1, tl.int32), 0)
        for i in tl.static_range(KSEL):
            best_s = tl.max(tl.full([BT], float("-inf"), tl.float32), 0)
            best_n = tl.max(tl.zeros([BT], tl.int32), 0)
            for n0 in range(0, nb, BT):
                n = n0 + tl.arange(0, BT)
                nv = n < nb
                means = tl.load(ks + n[:, None] * sksn + d[None, :], mask=nv[:, None], other=0.0) / bsize
                s = tl.sum(means * g[None, :], 1)
                ok = nv & (n < own) & ((s < prev_s) | ((s == prev_s) & (n > prev_n)))
                s = tl.where(ok, s, float("-inf"))
                top = tl.max(s, 0)
                at = tl.min(tl.where(s == top, n, 2147483647), 0)
                better = top > best_s  # tiles in block order: a tie keeps the lower block
                best_n = tl.where(better, at, best_n)
                best_s = tl.where(better, top, best_s)
            none = drop | (best_s == float("-inf"))
            lo = tl.load(BST + b * sbsb + best_n)
            hi = tl.load(BST + b * sbsb + tl.minimum(best_n + 1, nb - 1))
            tl.store(ST + out + i, tl.where(none, 0, lo).to(tl.int32))
            tl.store(EN + out + i, tl.where(none, 0, hi).to(tl.int32))
            prev_s = best_s
            prev_n = best_n


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


def store_step(k, v, keys, values, mask, pos, key_sums, block_start, n_real, real, *, block_size: int):
    """`reference_decode.store_step_reference` in one launch; returns the token's slot `[B]`."""
    B, Hkv, _, D = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    slot = torch.empty_like(pos)
    km = mask.view(torch.int8) if mask.dtype == torch.bool else mask
    rl = None if real is None else real.to(torch.int8).contiguous()
    _store_kernel[(B,)](
        k, v, keys, values, km, pos, key_sums, block_start, n_real, rl if rl is not None else pos, slot,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), km.stride(0), key_sums.stride(0), key_sums.stride(1),
        key_sums.stride(2), block_start.stride(0), block_size,
        HKV=Hkv, HP=triton.next_power_of_2(Hkv), D=D, HAS_REAL=real is not None, num_warps=1)
    return slot


def gate_ranges(q, key_sums, block_start, n_real, slot, real, *, block_size: int, top_k: int, min_seq_len: int,
                gating: str, query_sum):
    """`reference_decode.decode_gate` in one launch: (starts, ends) `[B, Hq, top_k]` int32, query_sum updated in
    place. Ties between scores take the lower block (the reference: `torch.topk`'s choice)."""
    B, Hq, _, D = q.shape
    Hkv, nb = key_sums.shape[1], key_sums.shape[2]
    k_sel = top_k - 1  # at every block count (a buffer of fewer blocks has empty earlier ranges): one kernel variant
    NL = k_sel + 1
    starts = torch.empty(B, Hq, NL, dtype=torch.int32, device=q.device)
    ends = torch.empty_like(starts)
    block = gating == "block"
    qs = query_sum if block and query_sum is not None else key_sums
    if q.stride(-1) != 1:
        q = q.contiguous()
    rl = None if real is None else real.to(torch.int8).contiguous()
    _gate_kernel[(B * Hq,)](
        q, qs, key_sums, block_start, n_real, rl if rl is not None else n_real, slot, starts, ends,
        q.stride(0), q.stride(1), key_sums.stride(0), key_sums.stride(1), key_sums.stride(2), block_start.stride(0),
        nb, block_size, min_seq_len,
        HQ=Hq, G=Hq // Hkv, D=D, KSEL=k_sel, NL=NL, BT=GATE_TILE, BLOCK_GATING=block,
        HAS_QS=block and query_sum is not None, HAS_REAL=real is not None, num_warps=2)
    return starts, ends


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


__all__ = ["BN", "GATE_TILE", "gate_ranges", "pieces", "ranges_attention", "store_step"]
