"""Triton kernels of the LoLCATs / LoLA attention (forward), each matched against `reference.py`
(tests/test_lola_kernels.py):

  hybrid_fwd        window softmax + sparse softmax + linear, one normaliser <- lola_attention / hybrid_attention_*
                    (stats=True: also the row statistics of the whole-sequence backward, triton_hybrid_bwd.py)
  decode_step       one query per (batch, head) against window/sparse/state <- lola_attention with S == 1
  feature_map       the Hedgehog feature map [softmax(x W), softmax(-x W)]  <- hedgehog_feature_map

They run under TRITON_INTERPRET=1 on the CPU (small shapes) and on CUDA. Works with triton 3.6 and 3.9.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import LOG2E, dot, dot_precision, np2, online_softmax_row, online_softmax_step
from .reference import HybridKeys, HybridRule, check_combine, feature_rows
from .tuning import DEFAULT_TUNING, LolaTuning


# ------------------------------------------------------------------------------------------- hybrid forward
@triton.jit
def _hybrid_fwd_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, HS, SS, SPK, SPV, SPM, O, MST, RST, AMST,
    M, N, NF, L, D, F2, G, GS, q_off, window, scale_log2, sp_chunk,
    s_q_b, s_q_h, s_q_m,
    s_k_b, s_k_h, s_k_n,
    s_v_b, s_v_h, s_v_n,
    s_fq_b, s_fq_h, s_fq_m,
    s_fk_b, s_fk_h, s_fk_n,
    s_km_b,
    s_hs_b, s_hs_h, s_hs_n, s_hs_f,
    s_ss_b, s_ss_h, s_ss_n,
    s_spk_b, s_spk_h, s_spk_l, s_spk_c,
    s_spv_b, s_spv_h, s_spv_l, s_spv_c,
    s_spm_b, s_spm_h, s_spm_c,
    s_o_b, s_o_m, s_o_h,
    HQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, BKS: tl.constexpr,
    CS: tl.constexpr, PER_BLOCK: tl.constexpr, HAS_KM: tl.constexpr, HAS_SP: tl.constexpr,
    PREC: tl.constexpr, STATS: tl.constexpr = False, UNSHIFTED: tl.constexpr = False,
    UPCAST: tl.constexpr = INTERPRET,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // G
    hs = h // GS
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_f = tl.arange(0, BF)
    mm = offs_m < M
    md = offs_d < D
    mf = offs_f < F2
    q = tl.load(Q + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_m + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    fq = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_m[:, None] * s_fq_m + offs_f[None, :],
                 mask=mm[:, None] & mf[None, :], other=0.0)
    qpos = q_off + offs_m  # key index of each query

    # the running max starts finite: a fully masked tile adds 0 (online_softmax without its EMPTY guard)
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_e = tl.zeros([BM], dtype=tl.float32)
    l_l = tl.zeros([BM], dtype=tl.float32)
    acc_e = tl.zeros([BM, BD], dtype=tl.float32)
    acc_l = tl.zeros([BM, BD], dtype=tl.float32)
    am = tl.zeros([BM], dtype=tl.int32)  # STATS: the window key of the row max (first of equal ones)

    # 1. linear state of every token before the first explicit key
    a0 = q_off + pid_m * BM
    if PER_BLOCK:
        n_blk = tl.maximum(a0 - window, 0) // CS
        lo = n_blk * CS
        n_state = n_blk.to(tl.int64)  # the state slot: 64-bit base offset (HS has NB slots of F2 * D per row)
    else:
        n_state = 0
        lo = 0
    for f0 in range(0, F2, BKS):  # fp32 state, read in slices of BKS features (bounded shared memory)
        offs_ks = f0 + tl.arange(0, BKS)
        mks = offs_ks < F2
        fqs = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_m[:, None] * s_fq_m + offs_ks[None, :],
                      mask=mm[:, None] & mks[None, :], other=0.0).to(tl.float32)
        hst = tl.load(HS + b * s_hs_b + h * s_hs_h + n_state * s_hs_n + offs_ks[:, None] * s_hs_f + offs_d[None, :],
                      mask=mks[:, None] & md[None, :], other=0.0)
        sst = tl.load(SS + b * s_ss_b + h * s_ss_h + n_state * s_ss_n + offs_ks, mask=mks, other=0.0)
        acc_l += dot(fqs, hst, PREC, UPCAST)
        l_l += tl.sum(fqs * sst[None, :], 1)

    # 2. sparse cache: exact keys of this query head's sparse head
    if HAS_SP:
        spc = (a0 // sp_chunk).to(tl.int64)  # the sparse set of this block's chunk (one set for all when sp_chunk is huge)
        for l0 in range(0, L, BN):
            offs_l = l0 + tl.arange(0, BN)
            ml = offs_l < L
            ml = ml & (tl.load(SPM + b * s_spm_b + hs * s_spm_h + spc * s_spm_c + offs_l, mask=offs_l < L,
                               other=0) != 0)
            sk = tl.load(SPK + b * s_spk_b + hs * s_spk_h + spc * s_spk_c + offs_l[:, None] * s_spk_l
                         + offs_d[None, :], mask=ml[:, None] & md[None, :], other=0.0)
            sv = tl.load(SPV + b * s_spv_b + hs * s_spv_h + spc * s_spv_c + offs_l[:, None] * s_spv_l
                         + offs_d[None, :], mask=ml[:, None] & md[None, :], other=0.0)
            sc = dot(q, tl.trans(sk.to(q.dtype)), PREC, UPCAST) * scale_log2
            sc = tl.where(ml[None, :], sc, float("-inf"))
            m_i, p, alpha = online_softmax_step(sc, m_i, True, False)
            acc_e = acc_e * alpha[:, None] + dot(p.to(sv.dtype), sv, PREC, UPCAST)
            l_e = l_e * alpha + tl.sum(p, 1)

    # 3. explicit keys: window softmax or linear by distance. A tile whose query-key distances all lie
    # beyond the window skips the softmax products, one whose distances all lie inside skips the linear ones
    # (distances in the tile: from a0 - (n0 + BN - 1) to a0 + BM - 1 - n0)
    hi = tl.minimum(N, a0 + BM)
    for n0 in range(lo, hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        mn = offs_n < N
        if HAS_KM:
            mn = mn & (tl.load(KM + b * s_km_b + offs_n, mask=offs_n < N, other=0) != 0)
        v = tl.load(V + b * s_v_b + hk * s_v_h + offs_n[:, None] * s_v_n + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0)
        diff = qpos[:, None] - offs_n[None, :]
        if a0 - (n0 + BN - 1) < window:  # some pair inside the window (the loop stops at the causal edge)
            k = tl.load(K + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                        mask=mn[:, None] & md[None, :], other=0.0)
            win = (diff >= 0) & (diff < window) & mn[None, :]
            sc = dot(q, tl.trans(k.to(q.dtype)), PREC, UPCAST) * scale_log2
            sc = tl.where(win, sc, float("-inf"))
            if STATS:
                am = tl.where(tl.max(sc, 1) > m_i, tl.argmax(sc, 1).to(tl.int32) + n0, am)
            m_i, p, alpha = online_softmax_step(sc, m_i, True, False)
            acc_e = acc_e * alpha[:, None] + dot(p.to(v.dtype), v, PREC, UPCAST)
            l_e = l_e * alpha + tl.sum(p, 1)
        if a0 + BM - 1 - n0 >= window:  # some pair beyond it
            fk = tl.load(FK + b * s_fk_b + h * s_fk_h + offs_n[:, None] * s_fk_n + offs_f[None, :],
                         mask=(mn & (offs_n < NF))[:, None] & mf[None, :], other=0.0)
            lin = (diff >= window) & mn[None, :]
            a = dot(fq, tl.trans(fk.to(fq.dtype)), PREC, UPCAST)
            a = tl.where(lin, a, 0.0)
            acc_l += dot(a.to(v.dtype), v, PREC, UPCAST)
            l_l += tl.sum(a, 1)

    gw = tl.load(GW + h).to(tl.float32)
    lw = tl.load(LFW + h).to(tl.float32)
    if UNSHIFTED:  # the exact term exp(s) as is: weights exp(min(m, 0)) and exp(-max(m, 0)) (m_i in log2 units),
        # both over the larger one the row uses (reference._finish: no underflow for rows far below 0)
        me = tl.minimum(m_i, 0.0)
        ml = -tl.maximum(m_i, 0.0)
        c = tl.where(l_l > 0, tl.maximum(me, ml), me)
        we = gw * tl.exp2(me - c)
        wl = lw * tl.exp2(tl.minimum(ml - c, 0.0))
        num = we[:, None] * acc_e + wl[:, None] * acc_l
        den = we * l_e + wl * l_l
    else:
        num = gw * acc_e + lw * acc_l
        den = gw * l_e + lw * l_l
    if STATS:  # the backward's row statistics [B, Hq, M]: max (log2 units), 1 / den (0 for den <= 0), argmax
        row = pid_bh * M + offs_m
        tl.store(MST + row, m_i, mask=mm)
        tl.store(RST + row, tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0), mask=mm)
        tl.store(AMST + row, am, mask=mm)
    den = tl.where(den > 0, den, 1.0)
    out = num / den[:, None]
    tl.store(O + b * s_o_b + offs_m[:, None] * s_o_m + h * s_o_h + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mm[:, None] & md[None, :])


def hybrid_fwd(q, fq, keys: HybridKeys, rule: HybridRule, *, block_m: int = 64, block_n: int = 64, out=None,
               stats: bool = False, tuning: LolaTuning = DEFAULT_TUNING):
    """Hybrid attention forward of the queries q/fq [B, Hq, S, D / F2] against `keys` (`reference.HybridKeys`: the
    local keys from a host `q_offset`, their features, padding, the linear state or per-block prefix states every
    `state_chunk` keys, the sparse cache or one set per `sparse_chunk` keys) under `rule` (`reference.HybridRule`:
    window, scale, g, lf, combine), as `reference.lola_attention` and `reference.hybrid_attention_quadratic`.
    Returns o [B, S, Hq, D] in q.dtype (or writes `out`); with `stats` (the training forward of `triton_hybrid_bwd`:
    no sparse cache, combine "shifted") (o, (m, r, am)), the per-row statistics [B, Hq, S] of the backward: the
    window max in log2 units (fp32), 1 / normaliser (fp32, 0 where it is <= 0) and the index of the window key that
    holds the max (int32, 0 for rows without a window key).

    block_m / block_n: queries per program and keys per tile (state_chunk a multiple of block_n; block_m must divide
    sparse_chunk and q_offset). tuning: the launch's warps and stages (`hybrid_num_warps`, `hybrid_num_stages`).
    """
    keys.check_states("hybrid_fwd")
    k, v, fk, Hs, Ss, key_mask = keys.k, keys.v, keys.fk, keys.H, keys.s, keys.key_mask
    q_offset = keys.k.shape[2] - q.shape[2] if keys.q_offset is None else int(keys.q_offset)
    state_chunk, sparse_chunk = keys.state_chunk, keys.sparse_chunk
    sp = keys.sparse
    sparse_k, sparse_v, sparse_valid = (sp.k, sp.v, sp.mask()) if sp is not None else (None, None, None)
    g, lf, window, combine = rule.g, rule.lf, rule.window, rule.combine
    scale = q.shape[-1] ** -0.5 if rule.scale is None else rule.scale
    unshifted = check_combine(combine)
    B, Hq, M, D = q.shape
    N = k.shape[2]
    F2 = fq.shape[-1]
    G = Hq // k.shape[1]
    NF = feature_rows(fk, q_offset, M, window)
    per_block = state_chunk > 0
    if not per_block:
        Hs, Ss = Hs.unsqueeze(2), Ss.unsqueeze(2)
    BM = min(block_m, np2(M))
    BN = block_n
    if per_block:
        assert state_chunk % BN == 0, "state_chunk must be a multiple of block_n"
    BD, BF = np2(D), np2(F2)
    if out is None:
        out = torch.empty(B, M, Hq, D, device=q.device, dtype=q.dtype)
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    per_chunk = sparse_chunk > 0
    has_sp = sparse_k is not None and sparse_k.shape[-2] > 0
    L = sparse_k.shape[-2] if has_sp else 0
    GS = Hq // sparse_k.shape[1] if has_sp else 1
    spm = sparse_valid.to(torch.int8).contiguous() if has_sp else None
    if per_chunk:
        assert sparse_chunk % BM == 0 and q_offset % BM == 0, "block_m must divide sparse_chunk and q_offset"
        assert sparse_k.dim() == 5, "per-chunk sparse sets are [B, Hs, NC, L, D]"
    cst = lambda t, i: t.stride(i) if (has_sp and per_chunk) else 0  # noqa: E731
    if NF == 0:
        fk = fq  # nothing is read from it
    gw = g.float().contiguous()
    lw = lf.float().contiguous()
    dummy = q
    if stats:
        assert not has_sp, "the backward's statistics are those of the training case (no sparse cache)"
        assert not unshifted, "the backward is LoLCATs' combination only (ops.hybrid_attention routes the other)"
        st_m = torch.empty(B, Hq, M, device=q.device, dtype=torch.float32)
        st_r = torch.empty(B, Hq, M, device=q.device, dtype=torch.float32)
        st_a = torch.empty(B, Hq, M, device=q.device, dtype=torch.int32)
    grid = (triton.cdiv(M, BM), B * Hq)
    _hybrid_fwd_kernel[grid](
        q, k, v, fq, fk, km if km is not None else dummy, gw, lw, Hs, Ss,
        sparse_k if has_sp else dummy, sparse_v if has_sp else dummy, spm if has_sp else dummy, out,
        st_m if stats else dummy, st_r if stats else dummy, st_a if stats else dummy,
        M, N, NF, L, D, F2, G, GS, q_offset, window, scale * LOG2E, sparse_chunk if per_chunk else 1 << 30,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        fq.stride(0), fq.stride(1), fq.stride(2),
        fk.stride(0), fk.stride(1), fk.stride(2),
        km.stride(0) if km is not None else 0,
        Hs.stride(0), Hs.stride(1), Hs.stride(2), Hs.stride(3),
        Ss.stride(0), Ss.stride(1), Ss.stride(2),
        sparse_k.stride(0) if has_sp else 0, sparse_k.stride(1) if has_sp else 0,
        sparse_k.stride(-2) if has_sp else 0, cst(sparse_k, 2),
        sparse_v.stride(0) if has_sp else 0, sparse_v.stride(1) if has_sp else 0,
        sparse_v.stride(-2) if has_sp else 0, cst(sparse_v, 2),
        spm.stride(0) if has_sp else 0, spm.stride(1) if has_sp else 0, cst(spm, 2),
        out.stride(0), out.stride(1), out.stride(2),
        HQ=Hq, BM=BM, BN=BN, BD=BD, BF=BF, BKS=min(BF, 32), CS=max(state_chunk, 1), PER_BLOCK=per_block,
        HAS_KM=km is not None, HAS_SP=has_sp, PREC=dot_precision(q, k, fq), STATS=stats, UNSHIFTED=unshifted,
        num_warps=tuning.hybrid_num_warps or 4,
        num_stages=tuning.hybrid_num_stages or (2 if max(BD, BF) >= 128 or q.dtype == torch.float32 else 3),
    )
    if stats:
        return out, (st_m, st_r, st_a)
    return out


# ------------------------------------------------------------------------------------------- decode
@triton.jit
def _decode_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, H, S, SPK, SPV, SPM, O, NK,
    N, NF, L, D, F2, G, GS, window, scale_log2,
    s_q_b, s_q_h,
    s_k_b, s_k_h, s_k_n,
    s_v_b, s_v_h, s_v_n,
    s_fq_b, s_fq_h,
    s_fk_b, s_fk_h, s_fk_n,
    s_km_b,
    s_h_b, s_h_h, s_h_f,
    s_s_b, s_s_h,
    s_spk_b, s_spk_h, s_spk_l,
    s_spv_b, s_spv_h, s_spv_l,
    s_spm_b, s_spm_h,
    s_o_b, s_o_h,
    HQ: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
    HAS_KM: tl.constexpr, HAS_SP: tl.constexpr, SP_SCORE: tl.constexpr, DEV_N: tl.constexpr,
    UNSHIFTED: tl.constexpr = False,
):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    if DEV_N:  # the buffered keys' count from the device (a decode step replayed from a graph): N is the capacity
        N = tl.load(NK).to(tl.int32)
    b = pid // HQ
    h = pid % HQ
    hk = h // G
    hs = h // GS
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    q = tl.load(Q + b * s_q_b + h * s_q_h + offs_d, mask=md, other=0.0).to(tl.float32)
    qpos = N - 1
    # linear state
    acc_l = tl.zeros([BD], dtype=tl.float32)
    l_l = tl.zeros([1], dtype=tl.float32)
    for f0 in range(0, F2, BK):
        offs_k = f0 + tl.arange(0, BK)
        mk = offs_k < F2
        fq = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_k, mask=mk, other=0.0).to(tl.float32)
        hh = tl.load(H + b * s_h_b + h * s_h_h + offs_k[:, None] * s_h_f + offs_d[None, :],
                     mask=mk[:, None] & md[None, :], other=0.0)
        ss = tl.load(S + b * s_s_b + h * s_s_h + offs_k, mask=mk, other=0.0)
        acc_l += tl.sum(fq[:, None] * hh, 0)
        l_l += tl.sum(fq * ss, 0)
    m_i = tl.full([1], -1.0e30, dtype=tl.float32)
    l_e = tl.zeros([1], dtype=tl.float32)
    acc_e = tl.zeros([BD], dtype=tl.float32)
    if HAS_SP:
        for l0 in range(0, L, BN):
            offs_l = l0 + tl.arange(0, BN)
            ml = offs_l < L
            if SP_SCORE:  # the sparse cache's scores: a slot holds a pair when its score is finite (> -inf)
                ml = ml & (tl.load(SPM + b * s_spm_b + hs * s_spm_h + offs_l, mask=offs_l < L,
                                   other=float("-inf")) > float("-inf"))
            else:
                ml = ml & (tl.load(SPM + b * s_spm_b + hs * s_spm_h + offs_l, mask=offs_l < L, other=0) != 0)
            sk = tl.load(SPK + b * s_spk_b + hs * s_spk_h + offs_l[:, None] * s_spk_l + offs_d[None, :],
                         mask=ml[:, None] & md[None, :], other=0.0).to(tl.float32)
            sv = tl.load(SPV + b * s_spv_b + hs * s_spv_h + offs_l[:, None] * s_spv_l + offs_d[None, :],
                         mask=ml[:, None] & md[None, :], other=0.0).to(tl.float32)
            sc = tl.sum(sk * q[None, :], 1) * scale_log2
            sc = tl.where(ml, sc, float("-inf"))
            m_i, l_e, acc_e = online_softmax_row(sc, sv, m_i, l_e, acc_e)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mn = offs_n < N
        if HAS_KM:
            mn = mn & (tl.load(KM + b * s_km_b + offs_n, mask=offs_n < N, other=0) != 0)
        k = tl.load(K + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + b * s_v_b + hk * s_v_h + offs_n[:, None] * s_v_n + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0).to(tl.float32)
        diff = qpos - offs_n
        win = (diff < window) & mn
        lin = (diff >= window) & mn
        sc = tl.sum(k * q[None, :], 1) * scale_log2
        sc = tl.where(win, sc, float("-inf"))
        m_i, l_e, acc_e = online_softmax_row(sc, v, m_i, l_e, acc_e)
        # linear part of the local keys older than the window: phi(q) . phi(k) per key
        a = tl.zeros([BN], dtype=tl.float32)
        for f0 in range(0, F2, BK):
            offs_k = f0 + tl.arange(0, BK)
            mk = offs_k < F2
            fq = tl.load(FQ + b * s_fq_b + h * s_fq_h + offs_k, mask=mk, other=0.0).to(tl.float32)
            fk = tl.load(FK + b * s_fk_b + h * s_fk_h + offs_n[:, None] * s_fk_n + offs_k[None, :],
                         mask=(lin & (offs_n < NF))[:, None] & mk[None, :], other=0.0).to(tl.float32)
            a += tl.sum(fk * fq[None, :], 1)
        a = tl.where(lin, a, 0.0)
        acc_l += tl.sum(a[:, None] * v, 0)
        l_l += tl.sum(a, 0)
    gw = tl.load(GW + h).to(tl.float32)
    lw = tl.load(LFW + h).to(tl.float32)
    if UNSHIFTED:  # as in the hybrid kernel: the linear term against exp(s), m_i in log2 units
        me = tl.minimum(m_i, 0.0)
        ml = -tl.maximum(m_i, 0.0)
        c = tl.where(l_l > 0, tl.maximum(me, ml), me)
        gw = gw * tl.exp2(me - c)
        lw = lw * tl.exp2(tl.minimum(ml - c, 0.0))
    num = gw * acc_e + lw * acc_l
    den = gw * l_e + lw * l_l
    den = tl.where(den > 0, den, 1.0)
    out = num / den
    tl.store(O + b * s_o_b + h * s_o_h + offs_d, out.to(O.dtype.element_ty), mask=md)


def decode_step(q, fq, keys: HybridKeys, rule: HybridRule, *, n_keys=None, out=None,
                tuning: LolaTuning = DEFAULT_TUNING):
    """One decode token: q [B, Hq, 1, D], fq [B, Hq, 1, F2] against `keys` (`reference.HybridKeys`): the local keys
    k/v [B, Hkv, N, D] with the new token the last of them (q_offset None), fk [B, Hq, NF, F2] the features of the
    first NF >= N - window of them (the ones attended linearly), their padding, the linear state H/s and the sparse
    cache [B, Hs, L, *], whose slots' validity the kernel reads from `SparseSet.score` (fp32: valid where > -inf; no
    conversion launched per step) or `SparseSet.valid` (bool); one linear state and one sparse set (state_chunk =
    sparse_chunk = 0). rule (`reference.HybridRule`): window, scale, g, lf, combine, as `hybrid_fwd`.
    `n_keys` (a device int64 tensor, its first element read in the kernel): the local keys are the first n_keys rows
    of k/v, the new token last, and fk must cover the first N - window rows (N = k.shape[2], the buffer's capacity):
    the launch is then the same whatever the count. Returns [B, 1, Hq, D] (or writes `out`)."""
    if keys.q_offset is not None or keys.state_chunk or keys.sparse_chunk:
        raise ValueError("decode_step: the query is the last local key (q_offset None; a count on the device comes as "
                         "n_keys), with one linear state and one sparse set (state_chunk = sparse_chunk = 0)")
    keys.check_states("decode_step")
    k, v, fk, H, s, key_mask, sp = keys.k, keys.v, keys.fk, keys.H, keys.s, keys.key_mask, keys.sparse
    g, lf, window = rule.g, rule.lf, rule.window
    unshifted = check_combine(rule.combine)
    B, Hq, _, D = q.shape
    scale = D ** -0.5 if rule.scale is None else rule.scale
    N = k.shape[2]
    F2 = fq.shape[-1]
    G = Hq // k.shape[1]
    NF = feature_rows(fk, N - 1, 1, window)
    if out is None:
        out = torch.empty(B, 1, Hq, D, device=q.device, dtype=q.dtype)
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    has_sp = keys.has_sparse
    sparse_k, sparse_v = (sp.k, sp.v) if has_sp else (None, None)
    sp_score = has_sp and sp.score is not None
    L = sparse_k.shape[2] if has_sp else 0
    GS = Hq // sparse_k.shape[1] if has_sp else 1
    if sp_score:
        spm = sp.score if sp.score.stride(-1) == 1 else sp.score.contiguous()
    else:
        spm = sp.valid.to(torch.int8).contiguous() if has_sp else None
    dummy = q
    if NF == 0:
        fk = fq  # nothing is read from it
    _decode_kernel[(B * Hq,)](
        q, k, v, fq, fk, km if km is not None else dummy, g.float().contiguous(), lf.float().contiguous(), H, s,
        sparse_k if has_sp else dummy, sparse_v if has_sp else dummy, spm if has_sp else dummy, out,
        n_keys if n_keys is not None else dummy,
        N, NF, L, D, F2, G, GS, window, scale * LOG2E,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        fq.stride(0), fq.stride(1),
        fk.stride(0), fk.stride(1), fk.stride(2),
        km.stride(0) if km is not None else 0,
        H.stride(0), H.stride(1), H.stride(2),
        s.stride(0), s.stride(1),
        sparse_k.stride(0) if has_sp else 0, sparse_k.stride(1) if has_sp else 0, sparse_k.stride(2) if has_sp else 0,
        sparse_v.stride(0) if has_sp else 0, sparse_v.stride(1) if has_sp else 0, sparse_v.stride(2) if has_sp else 0,
        spm.stride(0) if has_sp else 0, spm.stride(1) if has_sp else 0,
        out.stride(0), out.stride(2),
        HQ=Hq, BN=min(tuning.decode_bn or 64, np2(max(N, L))), BD=np2(D), BK=min(tuning.decode_bk or 64, np2(F2)),
        HAS_KM=km is not None, HAS_SP=has_sp, SP_SCORE=sp_score, DEV_N=n_keys is not None, UNSHIFTED=unshifted,
        num_warps=tuning.decode_warps or 2,  # H200, batch 16: 22.7 us against 42.2 with 4 (bench_lola_decode_step)
    )
    return out


# ------------------------------------------------------------------------------------------- feature map
@triton.jit
def _feature_map_kernel(
    X, W, O,
    N, D, F, G, eps,
    s_x_b, s_x_h, s_x_n,
    s_w_h, s_w_d,
    s_o_b, s_o_h, s_o_n,
    H: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr = INTERPRET,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // H
    h = pid_bh % H
    hx = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_f = tl.arange(0, BF)
    mm = offs_m < N
    md = offs_d < D
    mf = offs_f < F
    x = tl.load(X + b * s_x_b + hx * s_x_h + offs_m[:, None] * s_x_n + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    w = tl.load(W + h * s_w_h + offs_d[:, None] * s_w_d + offs_f[None, :], mask=md[:, None] & mf[None, :], other=0.0)
    p = dot(x.to(w.dtype), w, PREC, UPCAST)  # [BM, BF] fp32
    pp = tl.where(mf[None, :], p, float("-inf"))
    pn = tl.where(mf[None, :], -p, float("-inf"))
    ep = tl.exp(pp - tl.max(pp, 1)[:, None])
    en = tl.exp(pn - tl.max(pn, 1)[:, None])
    ep = tl.maximum(ep / tl.sum(ep, 1)[:, None], eps)
    en = tl.maximum(en / tl.sum(en, 1)[:, None], eps)
    base = O + b * s_o_b + h * s_o_h + offs_m[:, None] * s_o_n
    msk = mm[:, None] & mf[None, :]
    tl.store(base + offs_f[None, :], ep.to(O.dtype.element_ty), mask=msk)
    tl.store(base + F + offs_f[None, :], en.to(O.dtype.element_ty), mask=msk)


def fmap_precision(w, tuning: LolaTuning = DEFAULT_TUNING) -> str:
    """The feature map's projection precision: for fp32 weights `tuning.fmap_prec` when set, else "tf32x3" (three
    tf32 tensor-core products at fp32's accuracy: H200, the trainer's step 1.7% (transfer) / 3.6% (LoRA) faster
    than "ieee", benchmarks/results/finetune/train-throughput-fmap-prec-h200.json) on a GPU with tf32 (compute
    capability 8+) and "ieee" elsewhere (the interpreter, older GPUs); for other weights "tf32" (which bf16
    operands ignore). The forward and the backward's recomputation take the same."""
    if w.dtype != torch.float32:
        return "tf32"
    return tuning.fmap_prec or ("tf32x3" if w.is_cuda and _has_tf32(w.device.index) else "ieee")


@functools.lru_cache(maxsize=None)
def _has_tf32(index) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


def feature_map(x, weight, eps: float = 1e-12, out_dtype=None, out=None, tuning: LolaTuning = DEFAULT_TUNING):
    """phi(x) = [softmax(x W), softmax(-x W)] per head (forward only). x [B, Hx, N, D] (Hx divides H),
    weight [H, D, F]. The projection runs in the weight's dtype (fp32 weights: exact fp32 dot) with fp32
    accumulation; softmax in fp32. Returns [B, H, N, 2F] in out_dtype (default x.dtype), written into `out` when
    given (any strides with a unit last one: e.g. rows of a feature buffer)."""
    B, Hx, N, D = x.shape
    H, _, F = weight.shape
    if out is None:
        out = torch.empty(B, H, N, 2 * F, device=x.device, dtype=out_dtype or x.dtype)
    else:
        assert out.shape == (B, H, N, 2 * F) and out.stride(-1) == 1, (tuple(out.shape), out.stride())
    w = weight.contiguous()
    # rows per program: a decode step maps one row (the query, or the key leaving the window): a 16-row tile
    # (tl.dot's least) does a quarter of a 64-row tile's work
    BM = tuning.fmap_bm or max(16, min(64, np2(N)))
    grid = (triton.cdiv(N, BM), B * H)
    _feature_map_kernel[grid](
        x, w, out, N, D, F, H // Hx, eps,
        x.stride(0), x.stride(1), x.stride(2),
        w.stride(0), w.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        H=H, BM=BM, BD=np2(D), BF=np2(F), PREC=fmap_precision(w, tuning), num_warps=tuning.fmap_warps or 4,
    )
    return out
