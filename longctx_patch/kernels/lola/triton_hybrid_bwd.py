"""Triton backward of the LoLCATs hybrid attention over a whole sequence (the training case of
`ops.hybrid_attention`: no cache, q_offset 0, no sparse cache), matched against autograd through
`reference.hybrid_attention_quadratic` (tests/test_lola_hybrid_bwd.py). The forward is `triton_hybrid.hybrid_fwd`
with `stats=True` (the same kernel; it also writes the row max m, r = 1 / normaliser and the argmax key).

Maths, per query row i of head h (W_i window keys, L_i explicit linear keys, slot n the prefix state of i's block,
t_ij = r_i (do_i . v_j - delta_i), delta_i = do_i . o_i):

  window   dv_j += g p_ij r_i do_i, ds_ij = g p_ij t_ij (dq, dk), dg += p_ij t_ij
  max      m_i is not a cancelling stabiliser (the linear term is not rescaled by it), so o depends on it:
           dm_i = -sum_W ds_ij goes to the score of the argmax key (as torch.amax passes it)
  linear   dv_j += lf a_ij r_i do_i, da_ij = lf t_ij (dfq, dfk), dlf += a_ij t_ij
  state    dfq_i += lf r_i (H_n do_i - delta_i s_n), dlf += r_i fq_i . (H_n do_i - delta_i s_n);
           dH_n = sum_{rows of slot n} lf r_i fq_i do_i^T, ds_n = -sum lf r_i delta_i fq_i, and key j of state
           chunk c gets dfk_j += (sum_{n>c} dH_n) v_j + sum_{n>c} ds_n, dv_j += (sum_{n>c} dH_n)^T fk_j

Kernels (FlashAttention-2 layout), launched in this order after `chunk_states` recomputes the prefix states:

  _dq_kernel          one program per (query block, batch x query head): delta_i = do_i . o_i (written for
                      _dkv_kernel), then the keys the forward iterates (its state slot, then the explicit keys);
                      writes dq and dfq (input dtype), the per-row dm (for dk), the block's sums of the dg / dlf
                      row partials, and, for a block of slot n >= 1, its part of dH_n / ds_n (fp32, one buffer
                      row per block)
  _state_grad_kernel  one program per (batch x query head, tile of F2 x D): the blocks' parts summed per slot
                      and then over the slots after each chunk c (gH_c = sum_{n>c} dH_n, gs_c likewise) in a fixed
                      order: deterministic, no atomics (the slot of block a0 is max(a0 - window, 0) // CS, so a
                      slot's blocks are consecutive)
  _dkv_kernel         one program per (key block, batch x kv head): loops over the G query heads of the kv head
                      and the query blocks that see the key block explicitly (those whose state slot starts at or
                      before it), adds the max's gradient of the rows whose argmax key it holds (dm_i on that
                      score) and the state terms of its chunk c (dfk += v gH_c^T + gs_c, dv += fk gH_c, gH_c read in
                      slices); writes dk, dv (summed over the group) and dfk per query head, in the input dtype. dm_i
                      joins ds_ij before ds is rounded to the operands' dtype for the dk product (bf16: one
                      rounding of the sum)

The torch left: the prefix states' allocation and cumulative sums (`chunk_states`), the key mask's int8 copy,
the sum of the per-block dg / dlf partials over batch and blocks, and allocations.

Runs under TRITON_INTERPRET=1 on the CPU (small shapes) and on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import LOG2E, cast_out, dot, dot_precision, np2
from .reference import HybridKeys, HybridRule, check_combine
from .triton_state import chunk_states
from .tuning import DEFAULT_TUNING, LolaTuning


@triton.jit
def _dq_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, HS, SS, O, DO, MS, RS, AM, DL, DQ, DFQ, DMR, DGL, PH, PS,
    M, D, F2, G, NB, window, scale_log2, scale,
    s_q_b, s_q_h, s_q_m,
    s_k_b, s_k_h, s_k_n,
    s_f_b, s_f_h, s_f_m,
    s_km_b,
    s_hs_b, s_hs_h, s_hs_n, s_hs_f,
    s_ss_b, s_ss_h, s_ss_n,
    s_o_b, s_o_m, s_o_h,
    s_do_b, s_do_m, s_do_h,
    s_ph_b, s_ph_h, s_ph_n, s_ph_f,
    s_ps_b, s_ps_h, s_ps_n,
    HQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    BKD: tl.constexpr, CS: tl.constexpr, HAS_KM: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr = INTERPRET,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # 64-bit base offsets (docs/PERFORMANCE.md, "Large shapes")
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_f = tl.arange(0, BF)
    mm = offs_m < M
    md = offs_d < D
    mf = offs_f < F2
    q = tl.load(Q + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_m + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    fq = tl.load(FQ + b * s_f_b + h * s_f_h + offs_m[:, None] * s_f_m + offs_f[None, :],
                 mask=mm[:, None] & mf[None, :], other=0.0)
    do_base = DO + b * s_do_b + h * s_do_h + offs_m[:, None] * s_do_m
    do = tl.load(do_base + offs_d[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    row = pid_bh * M + offs_m
    m2 = tl.load(MS + row, mask=mm, other=0.0)
    r = tl.load(RS + row, mask=mm, other=0.0)
    # delta = do . o (the forward's fp32 output), written for the key-side kernel
    o = tl.load(O + b * s_o_b + h * s_o_h + offs_m[:, None] * s_o_m + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    dl = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DL + row, dl, mask=mm)
    gw = tl.load(GW + h).to(tl.float32)
    lw = tl.load(LFW + h).to(tl.float32)

    # 1. the prefix state of this block's slot (as the forward picks it): raw = H_n do - delta s_n, [BM, F2]
    a0 = pid_m * BM
    n_blk = tl.maximum(a0 - window, 0) // CS
    lo = n_blk * CS
    n_state = n_blk.to(tl.int64)
    raw = tl.zeros([BM, BF], dtype=tl.float32)
    for d0 in range(0, D, BKD):  # fp32 state, read in slices of BKD value dims (bounded shared memory)
        offs_ds = d0 + tl.arange(0, BKD)
        mds = offs_ds < D
        dos = tl.load(do_base + offs_ds[None, :], mask=mm[:, None] & mds[None, :], other=0.0).to(tl.float32)
        hst = tl.load(HS + b * s_hs_b + h * s_hs_h + n_state * s_hs_n + offs_f[:, None] * s_hs_f + offs_ds[None, :],
                      mask=mf[:, None] & mds[None, :], other=0.0)
        raw += dot(dos, tl.trans(hst), PREC, UPCAST)
    sst = tl.load(SS + b * s_ss_b + h * s_ss_h + n_state * s_ss_n + offs_f, mask=mf, other=0.0)
    raw = raw - dl[:, None] * sst[None, :]
    dlr = r * tl.sum(fq.to(tl.float32) * raw, 1)
    dfq = (lw * r)[:, None] * raw
    dq = tl.zeros([BM, BD], dtype=tl.float32)
    dgr = tl.zeros([BM], dtype=tl.float32)
    dmr = tl.zeros([BM], dtype=tl.float32)

    # 2. explicit keys, the forward's tiles (and its skips of tiles without window / linear pairs)
    hi = tl.minimum(M, a0 + BM)
    for n0 in range(lo, hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        mn = offs_n < M
        if HAS_KM:
            mn = mn & (tl.load(KM + b * s_km_b + offs_n, mask=offs_n < M, other=0) != 0)
        v = tl.load(V + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                    mask=mn[:, None] & md[None, :], other=0.0)
        diff = offs_m[:, None] - offs_n[None, :]
        t = r[:, None] * (dot(do, tl.trans(v.to(do.dtype)), PREC, UPCAST) - dl[:, None])
        if a0 - (n0 + BN - 1) < window:
            k = tl.load(K + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                        mask=mn[:, None] & md[None, :], other=0.0)
            win = (diff >= 0) & (diff < window) & mn[None, :]
            sc = dot(q, tl.trans(k.to(q.dtype)), PREC, UPCAST) * scale_log2
            sc = tl.where(win, sc, float("-inf"))
            p = tl.exp2(sc - m2[:, None])
            pt = p * t
            dgr += tl.sum(pt, 1)
            ds = gw * pt
            dmr -= tl.sum(ds, 1)
            dq += dot(ds.to(k.dtype), k, PREC, UPCAST)
        if a0 + BM - 1 - n0 >= window:
            fk = tl.load(FK + b * s_f_b + h * s_f_h + offs_n[:, None] * s_f_m + offs_f[None, :],
                         mask=mn[:, None] & mf[None, :], other=0.0)
            lin = (diff >= window) & mn[None, :]
            a = tl.where(lin, dot(fq, tl.trans(fk.to(fq.dtype)), PREC, UPCAST), 0.0)
            dlr += tl.sum(a * t, 1)
            da = tl.where(lin, lw * t, 0.0)
            dfq += dot(da.to(fk.dtype), fk, PREC, UPCAST)

    # 3. the max's gradient on the score of the argmax key (the forward's index); dk gets it in _dkv_kernel
    am = tl.load(AM + row, mask=mm, other=0).to(tl.int64)
    ka = tl.load(K + b * s_k_b + hk * s_k_h + am[:, None] * s_k_n + offs_d[None, :],
                 mask=mm[:, None] & md[None, :], other=0.0).to(tl.float32)
    dq = (dq + dmr[:, None] * ka) * scale
    tl.store(DQ + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_m + offs_d[None, :], cast_out(dq, DQ, UPCAST),
             mask=mm[:, None] & md[None, :])
    tl.store(DFQ + b * s_f_b + h * s_f_h + offs_m[:, None] * s_f_m + offs_f[None, :], cast_out(dfq, DFQ, UPCAST),
             mask=mm[:, None] & mf[None, :])
    tl.store(DMR + row, dmr, mask=mm)
    gl = (pid_bh * NB + pid_m) * 2  # this block's sums of the row partials of dg and dlf
    tl.store(DGL + gl, tl.sum(dgr, 0))
    tl.store(DGL + gl + 1, tl.sum(dlr, 0))

    # 4. this block's part of its slot's state gradient (slot 0 feeds no key): dH = (lf r fq)^T do [F2, D],
    # dS = -sum lf r delta fq [F2], fp32, summed per slot by _state_grad_kernel
    if n_blk > 0:
        x = (lw * r)[:, None] * fq.to(tl.float32)
        blk = pid_m.to(tl.int64)
        for d0 in range(0, D, BKD):
            offs_ds = d0 + tl.arange(0, BKD)
            mds = offs_ds < D
            dos = tl.load(do_base + offs_ds[None, :], mask=mm[:, None] & mds[None, :], other=0.0).to(tl.float32)
            ph = dot(tl.trans(x), dos, PREC, UPCAST)
            tl.store(PH + b * s_ph_b + h * s_ph_h + blk * s_ph_n + offs_f[:, None] * s_ph_f + offs_ds[None, :], ph,
                     mask=mf[:, None] & mds[None, :])
        tl.store(PS + b * s_ps_b + h * s_ps_h + blk * s_ps_n + offs_f, -tl.sum(x * dl[:, None], 0), mask=mf)


@triton.jit
def _state_grad_kernel(
    PH, PS, GH, GS,
    NB, NS, F2, D, window,
    s_ph_b, s_ph_h, s_ph_n, s_ph_f,
    s_ps_b, s_ps_h, s_ps_n,
    s_gh_b, s_gh_h, s_gh_n, s_gh_f,
    s_gs_b, s_gs_h, s_gs_n,
    HQ: tl.constexpr, BM: tl.constexpr, CS: tl.constexpr, TF: tl.constexpr, TD: tl.constexpr, ND: tl.constexpr,
):
    """GH[:, :, c] = sum of the query blocks' dH partials over the slots n > c (GS likewise): the blocks of slot
    n >= 1 are [cdiv(n * CS + window, BM), cdiv((n + 1) * CS + window, BM)) (slot = max(a0 - window, 0) // CS),
    summed in a fixed order (deterministic). One program per (batch x head, [TF, TD] tile of F2 x D)."""
    pid_bh = tl.program_id(0).to(tl.int64)  # 64-bit base offsets
    pid_t = tl.program_id(1)
    pid_f = pid_t // ND
    pid_d = pid_t % ND
    b = pid_bh // HQ
    h = pid_bh % HQ
    offs_f = pid_f * TF + tl.arange(0, TF)
    offs_d = pid_d * TD + tl.arange(0, TD)
    mf = offs_f < F2
    md = offs_d < D
    ms = mf & ((offs_f * 0 + pid_d) == 0)  # the first column tile also sums dS
    ph_base = PH + b * s_ph_b + h * s_ph_h + offs_f[:, None] * s_ph_f + offs_d[None, :]
    ps_base = PS + b * s_ps_b + h * s_ps_h + offs_f
    gh_base = GH + b * s_gh_b + h * s_gh_h + offs_f[:, None] * s_gh_f + offs_d[None, :]
    gs_base = GS + b * s_gs_b + h * s_gs_h + offs_f
    acc = tl.zeros([TF, TD], dtype=tl.float32)
    acs = tl.zeros([TF], dtype=tl.float32)
    for cc in range(0, NS):
        c = NS - 1 - cc  # from the last slot down: acc holds the blocks of the slots after c
        c64 = tl.cast(c, tl.int64)
        tl.store(gh_base + c64 * s_gh_n, acc, mask=mf[:, None] & md[None, :])
        tl.store(gs_base + c64 * s_gs_n, acs, mask=ms)
        i_lo = tl.minimum(tl.cdiv(c * CS + window, BM), NB)
        i_hi = tl.minimum(tl.cdiv((c + 1) * CS + window, BM), NB)
        if c == 0:
            i_hi = i_lo  # slot 0's blocks feed no key (and wrote no partial)
        for i in range(i_lo, i_hi):
            i64 = tl.cast(i, tl.int64)
            acc += tl.load(ph_base + i64 * s_ph_n, mask=mf[:, None] & md[None, :], other=0.0)
            acs += tl.load(ps_base + i64 * s_ps_n, mask=ms, other=0.0)


@triton.jit
def _dkv_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, DO, MS, RS, DL, AM, DMR, GH, GS, DK, DV, DFK,
    M, D, F2, G, NS, window, scale_log2, scale,
    s_q_b, s_q_h, s_q_m,
    s_k_b, s_k_h, s_k_n,
    s_f_b, s_f_h, s_f_m,
    s_km_b,
    s_do_b, s_do_m, s_do_h,
    s_gh_b, s_gh_h, s_gh_n, s_gh_f,
    s_gs_b, s_gs_h, s_gs_n,
    HQ: tl.constexpr, HKV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    BF: tl.constexpr, BKD: tl.constexpr, BKS: tl.constexpr, CS: tl.constexpr, HAS_KM: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr = INTERPRET,
):
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1).to(tl.int64)  # 64-bit base offsets
    b = pid_bk // HKV
    hk = pid_bk % HKV
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_f = tl.arange(0, BF)
    mn = offs_n < M
    if HAS_KM:
        mn = mn & (tl.load(KM + b * s_km_b + offs_n, mask=offs_n < M, other=0) != 0)
    md = offs_d < D
    mf = offs_f < F2
    k = tl.load(K + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                mask=mn[:, None] & md[None, :], other=0.0)
    v = tl.load(V + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                mask=mn[:, None] & md[None, :], other=0.0)
    dk = tl.zeros([BN, BD], dtype=tl.float32)
    dv = tl.zeros([BN, BD], dtype=tl.float32)
    # the query blocks that read this key block explicitly: a0 + BM > n0 (causal) and their state slot
    # max(a0 - window, 0) // CS at or before this block's chunk (CS is a multiple of BN)
    i_lo = n0 // BM
    i_hi = tl.minimum(tl.cdiv(M, BM), tl.cdiv((n0 // CS + 1) * CS + window, BM))
    # the state slots after this block's chunk read it through the prefix states
    chunk = n0 // CS
    c64 = chunk.to(tl.int64)
    for hh in range(0, G):
        h = hk * G + hh
        gw = tl.load(GW + h).to(tl.float32)
        lw = tl.load(LFW + h).to(tl.float32)
        fk = tl.load(FK + b * s_f_b + h * s_f_h + offs_n[:, None] * s_f_m + offs_f[None, :],
                     mask=mn[:, None] & mf[None, :], other=0.0)
        dfk = tl.zeros([BN, BF], dtype=tl.float32)
        for a0 in range(i_lo * BM, i_hi * BM, BM):
            offs_m = a0 + tl.arange(0, BM)
            mm = offs_m < M
            q = tl.load(Q + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_m + offs_d[None, :],
                        mask=mm[:, None] & md[None, :], other=0.0)
            do = tl.load(DO + b * s_do_b + h * s_do_h + offs_m[:, None] * s_do_m + offs_d[None, :],
                         mask=mm[:, None] & md[None, :], other=0.0)
            row = (b * HQ + h) * M + offs_m
            r = tl.load(RS + row, mask=mm, other=0.0)
            dl = tl.load(DL + row, mask=mm, other=0.0)
            diff = offs_m[:, None] - offs_n[None, :]
            t = r[:, None] * (dot(do, tl.trans(v.to(do.dtype)), PREC, UPCAST) - dl[:, None])
            if a0 - (n0 + BN - 1) < window:
                m2 = tl.load(MS + row, mask=mm, other=0.0)
                win = (diff >= 0) & (diff < window) & mn[None, :]
                sc = dot(q, tl.trans(k.to(q.dtype)), PREC, UPCAST) * scale_log2
                sc = tl.where(win, sc, float("-inf"))
                p = tl.exp2(sc - m2[:, None])
                dv += dot(tl.trans((gw * p * r[:, None]).to(do.dtype)), do, PREC, UPCAST)
                # the max's gradient dm_i (from _dq_kernel) on the score of row i's argmax key
                am = tl.load(AM + row, mask=mm, other=-1)
                dmr = tl.load(DMR + row, mask=mm, other=0.0)
                ds = gw * p * t + tl.where(offs_n[None, :] == am[:, None], dmr[:, None], 0.0)
                dk += dot(tl.trans(ds.to(q.dtype)), q, PREC, UPCAST)
            if a0 + BM - 1 - n0 >= window:
                fq = tl.load(FQ + b * s_f_b + h * s_f_h + offs_m[:, None] * s_f_m + offs_f[None, :],
                             mask=mm[:, None] & mf[None, :], other=0.0)
                lin = (diff >= window) & mn[None, :]
                a = tl.where(lin, dot(fq, tl.trans(fk.to(fq.dtype)), PREC, UPCAST), 0.0)
                dv += dot(tl.trans((lw * a * r[:, None]).to(do.dtype)), do, PREC, UPCAST)
                da = tl.where(lin, lw * t, 0.0)
                dfk += dot(tl.trans(da.to(fq.dtype)), fq, PREC, UPCAST)
        # the state terms: dfk += v gH_c^T + gS_c, dv += fk gH_c (gH_c: the sum of the slots after chunk c,
        # fp32, read in slices); padded keys get none
        if chunk < NS - 1:
            gh_base = GH + b * s_gh_b + h * s_gh_h + c64 * s_gh_n
            for d0 in range(0, D, BKD):
                offs_ds = d0 + tl.arange(0, BKD)
                mds = offs_ds < D
                vs = tl.load(V + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_ds[None, :],
                             mask=mn[:, None] & mds[None, :], other=0.0).to(tl.float32)
                ghs = tl.load(gh_base + offs_f[:, None] * s_gh_f + offs_ds[None, :],
                              mask=mf[:, None] & mds[None, :], other=0.0)
                dfk += dot(vs, tl.trans(ghs), PREC, UPCAST)
            gs = tl.load(GS + b * s_gs_b + h * s_gs_h + c64 * s_gs_n + offs_f, mask=mf, other=0.0)
            dfk += tl.where(mn[:, None], gs[None, :], 0.0)
            for f0 in range(0, F2, BKS):
                offs_fs = f0 + tl.arange(0, BKS)
                mfs = offs_fs < F2
                fks = tl.load(FK + b * s_f_b + h * s_f_h + offs_n[:, None] * s_f_m + offs_fs[None, :],
                              mask=mn[:, None] & mfs[None, :], other=0.0).to(tl.float32)
                ghs = tl.load(gh_base + offs_fs[:, None] * s_gh_f + offs_d[None, :],
                              mask=mfs[:, None] & md[None, :], other=0.0)
                dv += dot(fks, ghs, PREC, UPCAST)
        tl.store(DFK + b * s_f_b + h * s_f_h + offs_n[:, None] * s_f_m + offs_f[None, :],
                 cast_out(dfk, DFK, UPCAST), mask=(offs_n < M)[:, None] & mf[None, :])
    tl.store(DK + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
             cast_out(dk * scale, DK, UPCAST), mask=(offs_n < M)[:, None] & md[None, :])
    tl.store(DV + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
             cast_out(dv, DV, UPCAST), mask=(offs_n < M)[:, None] & md[None, :])


def hybrid_bwd(q, fq, keys: HybridKeys, rule: HybridRule, o, do, stats, *, tuning: LolaTuning = DEFAULT_TUNING):
    """Gradients (dq, dk, dv, dfq, dfk, dg, dlf) of `hybrid_fwd(q, fq, keys, rule, block_m, block_n, stats=True)` for
    the output gradient do [B, S, Hq, D] (unit last stride). keys (`reference.HybridKeys`) as the forward's: k/v
    [B, Hkv, S, D], fk [B, Hq, S, F2], key_mask, q_offset 0 (or None), per-block prefix states every `state_chunk`
    (> 0) keys, no sparse cache; its H/s: the prefix states as `chunk_states` makes them, or None (recomputed here,
    the forward keeps none). rule (`reference.HybridRule`): window >= 1, g, lf, scale, combine "shifted". q
    [B, Hq, S, D], fq [B, Hq, S, F2], k, v, fk contiguous, all of one dtype; o [B, S, Hq, D] the forward's output
    (fp32 as `ops.HybridAttentionFn` keeps it), stats its (m, r, am). Each gradient in its input's dtype. tuning: the
    launch settings; its `train_block_m` / `train_block_n` (None: 64) are the forward's tiles block_m / block_n, as
    `ops.HybridAttentionFn` runs both passes."""
    k, v, fk, key_mask, cs = keys.k, keys.v, keys.fk, keys.key_mask, keys.state_chunk
    g, lf, window = rule.g, rule.lf, rule.window
    assert keys.q_offset in (None, 0) and not keys.has_sparse and cs > 0, \
        "the backward of the whole-sequence hybrid: q_offset 0, per-block states (state_chunk > 0), no sparse cache"
    assert not check_combine(rule.combine), "the backward is LoLCATs' combination only (combine 'shifted')"
    scale = q.shape[-1] ** -0.5 if rule.scale is None else rule.scale
    B, Hq, M, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    F2 = fq.shape[-1]
    # the forward's tiles: the split state / explicit keys depends on them
    BM = min(int(tuning.train_block_m or 64), np2(M))
    BN = int(tuning.train_block_n or 64)
    assert cs % BN == 0 and window >= 1
    assert all(x.is_contiguous() for x in (q, k, v, fq, fk)) and do.stride(-1) == 1 and o.stride(-1) == 1
    m2, r, am = stats
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    Hs, Ss = (keys.H, keys.s) if keys.H is not None else chunk_states(fk, v, cs, key_mask=key_mask)
    NS = Hs.shape[2]
    NB = triton.cdiv(M, BM)
    gw = g.detach().float().contiguous()
    lw = lf.detach().float().contiguous()
    f32 = dict(device=q.device, dtype=torch.float32)
    dq, dk, dv, dfq, dfk = (torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (q, k, v, fq, fk))
    delta, dmr = torch.empty(B, Hq, M, **f32), torch.empty(B, Hq, M, **f32)
    dgl = torch.empty(B * Hq * NB * 2, **f32)  # per query block: the sums of dg's and dlf's row partials
    if NS > 1:  # per query block: its part of its slot's state gradient (blocks of slot 0 write none)
        ph, ps = torch.empty(B, Hq, NB, F2, D, **f32), torch.empty(B, Hq, NB, F2, **f32)
    else:
        ph, ps = Hs, Ss  # nothing is written
    BD, BF = np2(D), np2(F2)
    prec = dot_precision(q, k, fq)
    # H200 sweep at D = 64, F2 = 128 (benchmarks/results/lola/train-hybrid-bwd-sweep-h200.json): 4 warps in both
    # kernels and one stage, 3.07 ms against 4.07 ms with 8 warps and 2 stages, the earlier untimed guess. Wider
    # heads (D = 128: [64, 128] accumulators for dq, dk, dv next to dfq/dfk) keep that guess, not measured
    warps, stages = (4, 1) if BD <= 64 else (8, 2)
    dummy = q
    _dq_kernel[(NB, B * Hq)](
        q, k, v, fq, fk, km if km is not None else dummy, gw, lw, Hs, Ss, o, do, m2, r, am, delta,
        dq, dfq, dmr, dgl, ph, ps,
        M, D, F2, G, NB, window, scale * LOG2E, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        fq.stride(0), fq.stride(1), fq.stride(2),
        km.stride(0) if km is not None else 0,
        Hs.stride(0), Hs.stride(1), Hs.stride(2), Hs.stride(3),
        Ss.stride(0), Ss.stride(1), Ss.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        ph.stride(0), ph.stride(1), ph.stride(2), ph.stride(3),
        ps.stride(0), ps.stride(1), ps.stride(2),
        HQ=Hq, BM=BM, BN=BN, BD=BD, BF=BF, BKD=min(BD, 32), CS=cs, HAS_KM=km is not None, PREC=prec,
        num_warps=tuning.bwd_dq_warps or warps, num_stages=tuning.bwd_stages or stages,
    )
    del Hs, Ss
    if NS > 1:
        # the exclusive suffix sums over slots: key chunk c feeds every slot n > c
        gh, gs = torch.empty(B, Hq, NS, F2, D, **f32), torch.empty(B, Hq, NS, F2, **f32)
        TF, TD = min(BF, 32), min(BD, 64)
        ND = triton.cdiv(D, TD)
        _state_grad_kernel[(B * Hq, triton.cdiv(F2, TF) * ND)](
            ph, ps, gh, gs,
            NB, NS, F2, D, window,
            ph.stride(0), ph.stride(1), ph.stride(2), ph.stride(3),
            ps.stride(0), ps.stride(1), ps.stride(2),
            gh.stride(0), gh.stride(1), gh.stride(2), gh.stride(3),
            gs.stride(0), gs.stride(1), gs.stride(2),
            HQ=Hq, BM=BM, CS=cs, TF=TF, TD=TD, ND=ND, num_warps=4,
        )
        del ph, ps
    else:
        gh, gs = dmr, dmr  # nothing is read
    _dkv_kernel[(triton.cdiv(M, BN), B * Hkv)](
        q, k, v, fq, fk, km if km is not None else dummy, gw, lw, do, m2, r, delta, am, dmr, gh, gs, dk, dv, dfk,
        M, D, F2, G, NS, window, scale * LOG2E, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        fq.stride(0), fq.stride(1), fq.stride(2),
        km.stride(0) if km is not None else 0,
        do.stride(0), do.stride(1), do.stride(2),
        gh.stride(0) if NS > 1 else 0, gh.stride(1) if NS > 1 else 0, gh.stride(2) if NS > 1 else 0,
        gh.stride(3) if NS > 1 else 0,
        gs.stride(0) if NS > 1 else 0, gs.stride(1) if NS > 1 else 0, gs.stride(2) if NS > 1 else 0,
        HQ=Hq, HKV=Hkv, BM=BM, BN=BN, BD=BD, BF=BF, BKD=min(BD, 32), BKS=min(BF, 32), CS=cs,
        HAS_KM=km is not None, PREC=prec,
        num_warps=tuning.bwd_dkv_warps or warps, num_stages=tuning.bwd_stages or stages,
    )
    dgl = dgl.view(B, Hq, NB, 2).sum((0, 2))  # [Hq, 2]
    return dq, dk, dv, dfq, dfk, dgl[:, 0].to(g.dtype), dgl[:, 1].to(lf.dtype)
