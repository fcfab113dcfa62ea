"""Triton kernels of OVQ's chunk attention (`ops.OVQChunkAttention`): one softmax over [dictionary rows (+ log-count
bias)] + [chunk keys, causal].

Keys are given concatenated: rows ``0 .. n_dict-1`` of ``k`` are dictionary rows (visible to every
query), rows ``n_dict ..`` are the chunk's own keys at chunk positions ``0 ..``; query ``r`` sits at
chunk position ``r + q_off``.  ``bias`` (float32, ``[B, H, Lk]``) is added to every logit
(log counts for dictionary rows, 0 or -inf for chunk keys).  GQA: query head ``h`` reads key head
``h // (Hq // H)``.  Rows that see no key give 0.

The backward gives gradients for ``q``, ``k`` and ``v`` (dictionary rows included); ``bias`` is not
differentiated (counts are discrete).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import dot


@triton.jit
def _ovq_attn_fwd(Q, K, V, BIAS, O, LSE,
                  sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sbb, sbh, sob, soh, som,
                  M, LK, n_dict, q_off, HQ, G,
                  D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // HQ
    hq = pid_bh % HQ
    hk = hq // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    mask_m = offs_m < M
    q = tl.load(Q + b * sqb + hq * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV], tl.float32)
    hi = tl.minimum(n_dict + (pid_m + 1) * BM + q_off, LK)
    kbase = K + b * skb + hk * skh
    vbase = V + b * svb + hk * svh
    bbase = BIAS + b * sbb + hk * sbh
    for start in range(0, hi, BN):
        offs_n = start + tl.arange(0, BN)
        in_k = offs_n < LK
        k = tl.load(kbase + offs_n[:, None] * skn + offs_d[None, :], mask=in_k[:, None], other=0.0)
        s = dot(q, tl.trans(k), "ieee", UP) * 1.4426950408889634
        bias = tl.load(bbase + offs_n, mask=in_k, other=float("-inf"))
        s = s + bias[None, :] * 1.4426950408889634
        allowed = (offs_n[None, :] < n_dict) | ((offs_n[None, :] - n_dict) <= (offs_m[:, None] + q_off))
        allowed = allowed & in_k[None, :]
        s = tl.where(allowed, s, float("-inf"))
        # the online-softmax step written out, in this kernel's own order (p before alpha): with the order of
        # triton_lib.online_softmax_step (alpha first) it compiles to other sm_90 code (same instructions,
        # scheduled and allocated differently)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vbase + offs_n[:, None] * svn + offs_dv[None, :], mask=in_k[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, "ieee", UP)
        m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, (m_fin + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("inf"))
    tl.store(O + b * sob + hq * soh + offs_m[:, None] * som + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=mask_m[:, None])
    tl.store(LSE + pid_bh * M + offs_m, lse, mask=mask_m)


@triton.jit
def _ovq_attn_bwd_dq(Q, K, V, BIAS, DO, LSE, DELTA, DQ,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sbb, sbh,
                     M, LK, n_dict, q_off, HQ, G,
                     D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // HQ
    hq = pid_bh % HQ
    hk = hq // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    mask_m = offs_m < M
    qoff_ptr = b * sqb + hq * sqh + offs_m[:, None] * sqm
    q = tl.load(Q + qoff_ptr + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    do = tl.load(DO + qoff_ptr + offs_dv[None, :], mask=mask_m[:, None], other=0.0)
    lse = tl.load(LSE + pid_bh * M + offs_m, mask=mask_m, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * M + offs_m, mask=mask_m, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    hi = tl.minimum(n_dict + (pid_m + 1) * BM + q_off, LK)
    kbase = K + b * skb + hk * skh
    vbase = V + b * svb + hk * svh
    bbase = BIAS + b * sbb + hk * sbh
    for start in range(0, hi, BN):
        offs_n = start + tl.arange(0, BN)
        in_k = offs_n < LK
        k = tl.load(kbase + offs_n[:, None] * skn + offs_d[None, :], mask=in_k[:, None], other=0.0)
        v = tl.load(vbase + offs_n[:, None] * svn + offs_dv[None, :], mask=in_k[:, None], other=0.0)
        bias = tl.load(bbase + offs_n, mask=in_k, other=float("-inf"))
        s = dot(q, tl.trans(k), "ieee", UP) + bias[None, :]
        allowed = (offs_n[None, :] < n_dict) | ((offs_n[None, :] - n_dict) <= (offs_m[:, None] + q_off))
        allowed = allowed & in_k[None, :] & mask_m[:, None]
        p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
        dp = dot(do, tl.trans(v), "ieee", UP)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(k.dtype), k, "ieee", UP)
    tl.store(DQ + qoff_ptr + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=mask_m[:, None])


@triton.jit
def _ovq_attn_bwd_dkdv(Q, K, V, BIAS, DO, LSE, DELTA, DK, DV_,
                       sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sbb, sbh,
                       M, LK, n_dict, q_off, HK, G,
                       D: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // HK
    hk = pid_bh % HK
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    in_k = offs_n < LK
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=in_k[:, None], other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :], mask=in_k[:, None], other=0.0)
    bias = tl.load(BIAS + b * sbb + hk * sbh + offs_n, mask=in_k, other=float("-inf"))
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, DV], tl.float32)
    # first query row that may see a chunk key of this block
    first_chunk = pid_n * BN - n_dict
    lo = tl.where(first_chunk > q_off, first_chunk - q_off, 0)
    lo = (lo // BM) * BM
    bq = b * HK * G  # the first query head of this batch row, 64-bit (HK * G alone is a 32-bit product)
    for gi in range(0, G):
        hq = hk * G + gi
        qbase = Q + b * sqb + hq * sqh
        dobase = DO + b * sqb + hq * sqh
        for start in range(lo, M, BM):
            offs_m = start + tl.arange(0, BM)
            mask_m = offs_m < M
            q = tl.load(qbase + offs_m[:, None] * sqm + offs_d[None, :], mask=mask_m[:, None], other=0.0)
            do = tl.load(dobase + offs_m[:, None] * sqm + offs_dv[None, :], mask=mask_m[:, None], other=0.0)
            lse = tl.load(LSE + (bq + hq) * M + offs_m, mask=mask_m, other=float("inf"))
            delta = tl.load(DELTA + (bq + hq) * M + offs_m, mask=mask_m, other=0.0)
            s = dot(q, tl.trans(k), "ieee", UP) + bias[None, :]
            allowed = (offs_n[None, :] < n_dict) | ((offs_n[None, :] - n_dict) <= (offs_m[:, None] + q_off))
            allowed = allowed & in_k[None, :] & mask_m[:, None]
            p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
            dv += dot(tl.trans(p.to(do.dtype)), do, "ieee", UP)
            dp = dot(do, tl.trans(v), "ieee", UP)
            ds = p * (dp - delta[:, None])
            dk += dot(tl.trans(ds.to(q.dtype)), q, "ieee", UP)
    tl.store(DK + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=in_k[:, None])
    tl.store(DV_ + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :], dv.to(DV_.dtype.element_ty),
             mask=in_k[:, None])


def _blocks(M: int) -> tuple[int, int]:
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    return bm, 64


def attn_fwd(q, k, v, bias, n_dict: int, q_off: int):
    """The forward kernel on contiguous q, k, v and fp32 bias: (o [B, Hq, M, Dv] fp32, lse [B, Hq, M] fp32)."""
    B, HQ, M, D = q.shape
    H, LK = k.shape[1], k.shape[2]
    DV = v.shape[-1]
    # float32 output: the backward's rowsum(dO * O) then carries no bf16 rounding (it cancels
    # against dP for peaked softmax rows)
    o = torch.empty(B, HQ, M, DV, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, HQ, M, device=q.device, dtype=torch.float32)
    BM, BN = _blocks(M)
    grid = (triton.cdiv(M, BM), B * HQ)
    _ovq_attn_fwd[grid](q, k, v, bias, o, lse,
                        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                        v.stride(0), v.stride(1), v.stride(2), bias.stride(0), bias.stride(1),
                        o.stride(0), o.stride(1), o.stride(2),
                        M, LK, n_dict, q_off, HQ, HQ // H, D=D, DV=DV, BM=BM, BN=BN, UP=INTERPRET)
    return o, lse


def attn_bwd(q, k, v, bias, o, lse, do, n_dict: int, q_off: int):
    """The backward kernels (dq; dk and dv) from the forward's saved tensors and do in q's dtype: (dq, dk, dv)."""
    B, HQ, M, D = q.shape
    H, LK = k.shape[1], k.shape[2]
    DV = v.shape[-1]
    delta = (o * do.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    BM, BN = _blocks(M)
    G = HQ // H
    args = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), bias.stride(0), bias.stride(1))
    _ovq_attn_bwd_dq[(triton.cdiv(M, BM), B * HQ)](q, k, v, bias, do, lse, delta, dq, *args,
                                                   M, LK, n_dict, q_off, HQ, G,
                                                   D=D, DV=DV, BM=BM, BN=BN, UP=INTERPRET)
    _ovq_attn_bwd_dkdv[(triton.cdiv(LK, BN), B * H)](q, k, v, bias, do, lse, delta, dk, dv, *args,
                                                     M, LK, n_dict, q_off, H, G,
                                                     D=D, DV=DV, BM=BM, BN=BN, UP=INTERPRET)
    return dq, dk, dv
