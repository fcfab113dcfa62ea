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

Kernels (FlashAttention-2 layout): `_dq_kernel`, one program per (query block, batch x query head), iterates the
keys the forward iterates (its state slot, then the explicit keys) and writes dq, dfq and the per-row partials of
dg, dlf and dm; `_dkv_kernel`, one program per (key block, batch x kv head), loops over the G query heads of the
kv head and the query blocks that see the key block explicitly (those whose state slot starts at or before it),
writing dk, dv (summed over the group) and dfk per query head. The state terms of dfk / dv (suffix sums over
the few slots, [B, Hq, NS, F2, D]), the argmax scatter into dk and the sums of the row partials are torch.

Runs under TRITON_INTERPRET=1 on the CPU (small shapes) and on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import LOG2E, dot, dot_precision, np2
from .triton_state import chunk_states
from .tuning import TUNE


@triton.jit
def _dq_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, HS, SS, DO, MS, RS, DL, AM, DQ, DFQ, DGR, DLR, DMR,
    M, D, F2, G, window, scale_log2, scale,
    s_q_b, s_q_h, s_q_m,
    s_k_b, s_k_h, s_k_n,
    s_f_b, s_f_h, s_f_m,
    s_km_b,
    s_hs_b, s_hs_h, s_hs_n, s_hs_f,
    s_ss_b, s_ss_h, s_ss_n,
    s_do_b, s_do_m, s_do_h,
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
    dl = tl.load(DL + row, mask=mm, other=0.0)
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

    # 3. the max's gradient on the score of the argmax key (the forward's index)
    am = tl.load(AM + row, mask=mm, other=0).to(tl.int64)
    ka = tl.load(K + b * s_k_b + hk * s_k_h + am[:, None] * s_k_n + offs_d[None, :],
                 mask=mm[:, None] & md[None, :], other=0.0).to(tl.float32)
    dq = (dq + dmr[:, None] * ka) * scale
    tl.store(DQ + b * s_q_b + h * s_q_h + offs_m[:, None] * s_q_m + offs_d[None, :], dq,
             mask=mm[:, None] & md[None, :])
    tl.store(DFQ + b * s_f_b + h * s_f_h + offs_m[:, None] * s_f_m + offs_f[None, :], dfq,
             mask=mm[:, None] & mf[None, :])
    tl.store(DGR + row, dgr, mask=mm)
    tl.store(DLR + row, dlr, mask=mm)
    tl.store(DMR + row, dmr, mask=mm)


@triton.jit
def _dkv_kernel(
    Q, K, V, FQ, FK, KM, GW, LFW, DO, MS, RS, DL, DK, DV, DFK,
    M, D, F2, G, window, scale_log2, scale,
    s_q_b, s_q_h, s_q_m,
    s_k_b, s_k_h, s_k_n,
    s_f_b, s_f_h, s_f_m,
    s_km_b,
    s_do_b, s_do_m, s_do_h,
    HQ: tl.constexpr, HKV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    BF: tl.constexpr, CS: tl.constexpr, HAS_KM: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr = INTERPRET,
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
                ds = gw * p * t
                dk += dot(tl.trans(ds.to(q.dtype)), q, PREC, UPCAST)
            if a0 + BM - 1 - n0 >= window:
                fq = tl.load(FQ + b * s_f_b + h * s_f_h + offs_m[:, None] * s_f_m + offs_f[None, :],
                             mask=mm[:, None] & mf[None, :], other=0.0)
                lin = (diff >= window) & mn[None, :]
                a = tl.where(lin, dot(fq, tl.trans(fk.to(fq.dtype)), PREC, UPCAST), 0.0)
                dv += dot(tl.trans((lw * a * r[:, None]).to(do.dtype)), do, PREC, UPCAST)
                da = tl.where(lin, lw * t, 0.0)
                dfk += dot(tl.trans(da.to(fq.dtype)), fq, PREC, UPCAST)
        tl.store(DFK + b * s_f_b + h * s_f_h + offs_n[:, None] * s_f_m + offs_f[None, :], dfk,
                 mask=(offs_n < M)[:, None] & mf[None, :])
    tl.store(DK + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :], dk * scale,
             mask=(offs_n < M)[:, None] & md[None, :])
    tl.store(DV + b * s_k_b + hk * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :], dv,
             mask=(offs_n < M)[:, None] & md[None, :])


def _slot_rows(M: int, BM: int, window: int, cs: int) -> dict[int, tuple[int, int]]:
    """The rows [start, end) of each state slot n > 0 (the forward's choice per query block)."""
    rows: dict[int, tuple[int, int]] = {}
    for a0 in range(0, M, BM):
        n = max(a0 - window, 0) // cs
        if n > 0:
            s, _ = rows.get(n, (a0, 0))
            rows[n] = (s, min(a0 + BM, M))
    return rows


def hybrid_bwd(q, k, v, fq, fk, g, lf, o, do, stats, *, window: int, scale: float, key_mask=None,
               state_chunk: int = 256, block_m: int = 64, block_n: int = 64):
    """Gradients (dq, dk, dv, dfq, dfk, dg, dlf) of `hybrid_fwd(..., q_offset=0, state_chunk=state_chunk,
    block_m, block_n, stats=True)` (prefix states from `chunk_states`, recomputed here) for the output gradient
    do [B, S, Hq, D] (unit last stride). q [B, Hq, S, D], k/v [B, Hkv, S, D], fq/fk [B, Hq, S, F2] contiguous,
    all of one dtype; o the forward's output, stats its (m, r, am). Each gradient in its input's dtype."""
    B, Hq, M, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    F2 = fq.shape[-1]
    cs = state_chunk
    BM = min(block_m, np2(M))  # the forward's tiles: the split state / explicit keys depends on them
    BN = block_n
    assert cs % BN == 0 and window >= 1
    assert all(x.is_contiguous() for x in (q, k, v, fq, fk)) and do.stride(-1) == 1
    m2, r, am = stats
    km = key_mask.to(torch.int8).contiguous() if key_mask is not None else None
    Hs, Ss = chunk_states(fk, v, cs, key_mask=key_mask)
    NS = Hs.shape[2]
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()  # [B, Hq, S]
    gw = g.detach().float().contiguous()
    lw = lf.detach().float().contiguous()
    f32 = dict(device=q.device, dtype=torch.float32)
    dq, dfq, dk, dv, dfk = (torch.empty(x.shape, **f32) for x in (q, fq, k, v, fk))
    dgr, dlr, dmr = (torch.empty(B, Hq, M, **f32) for _ in range(3))
    BD, BF = np2(D), np2(F2)
    prec = dot_precision(q, k, fq)
    # untimed guess (FlashAttention-2's backward takes 8 warps at 128-wide tiles): [64, F2 = 128] fp32
    # accumulators (dfq, dfk) next to the [64, 64] ones
    warps = 8 if max(BD, BF) >= 128 else 4
    dummy = q
    _dq_kernel[(triton.cdiv(M, BM), B * Hq)](
        q, k, v, fq, fk, km if km is not None else dummy, gw, lw, Hs, Ss, do, m2, r, delta, am,
        dq, dfq, dgr, dlr, dmr,
        M, D, F2, G, window, scale * LOG2E, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        fq.stride(0), fq.stride(1), fq.stride(2),
        km.stride(0) if km is not None else 0,
        Hs.stride(0), Hs.stride(1), Hs.stride(2), Hs.stride(3),
        Ss.stride(0), Ss.stride(1), Ss.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        HQ=Hq, BM=BM, BN=BN, BD=BD, BF=BF, BKD=min(BD, 32), CS=cs, HAS_KM=km is not None, PREC=prec,
        num_warps=TUNE["bwd_dq_warps"] or warps, num_stages=TUNE["bwd_stages"] or 2,
    )
    _dkv_kernel[(triton.cdiv(M, BN), B * Hkv)](
        q, k, v, fq, fk, km if km is not None else dummy, gw, lw, do, m2, r, delta, dk, dv, dfk,
        M, D, F2, G, window, scale * LOG2E, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        fq.stride(0), fq.stride(1), fq.stride(2),
        km.stride(0) if km is not None else 0,
        do.stride(0), do.stride(1), do.stride(2),
        HQ=Hq, HKV=Hkv, BM=BM, BN=BN, BD=BD, BF=BF, CS=cs, HAS_KM=km is not None, PREC=prec,
        num_warps=TUNE["bwd_dkv_warps"] or warps, num_stages=TUNE["bwd_stages"] or 2,
    )
    del Hs, Ss

    # the max's gradient into dk: row i of head h adds scale * dm_i * q_i to its argmax key (of kv head h // G)
    idx = (torch.arange(B, device=q.device).view(B, 1, 1) * Hkv
           + (torch.arange(Hq, device=q.device) // G).view(1, Hq, 1)) * M + am.long()
    src = (dmr * scale).unsqueeze(-1) * q.float()
    dk.view(B * Hkv * M, D).index_add_(0, idx.reshape(-1), src.reshape(-1, D))

    # the prefix states: suffix sums over slots of dH_n = sum_{rows of n} lf r fq do^T, ds_n = -sum lf r delta fq
    if NS > 1:
        dof = do.float().transpose(1, 2)  # [B, Hq, S, D]
        x = (lw.view(1, Hq, 1) * r).unsqueeze(-1) * fq.float()  # [B, Hq, S, F2]
        dH = torch.zeros(B, Hq, NS, F2, D, **f32)
        dS = torch.zeros(B, Hq, NS, F2, **f32)
        for n, (s0, s1) in _slot_rows(M, BM, window, cs).items():
            dH[:, :, n] = x[:, :, s0:s1].transpose(-1, -2) @ dof[:, :, s0:s1]
            dS[:, :, n] = -(x[:, :, s0:s1] * delta[:, :, s0:s1, None]).sum(2)
        # key chunk c feeds every slot n > c: exclusive suffix sums
        gH = torch.flip(torch.cumsum(torch.flip(dH, [2]), 2), [2]) - dH
        gS = torch.flip(torch.cumsum(torch.flip(dS, [2]), 2), [2]) - dS
        del dH, dS, x
        pad = NS * cs - M
        gH6 = gH.view(B, Hkv, G, NS, F2, D)
        vp = torch.nn.functional.pad(v.float(), (0, 0, 0, pad)).view(B, Hkv, NS, cs, D)
        fkp = torch.nn.functional.pad(fk.float(), (0, 0, 0, pad)).view(B, Hkv, G, NS, cs, F2)
        dfk_s = torch.einsum("bkncd,bkgnfd->bkgncf", vp, gH6) + gS.view(B, Hkv, G, NS, 1, F2)
        dv_s = torch.einsum("bkgncf,bkgnfd->bkncd", fkp, gH6)
        dfk_s = dfk_s.reshape(B, Hq, NS * cs, F2)[:, :, :M]
        dv_s = dv_s.reshape(B, Hkv, NS * cs, D)[:, :, :M]
        if key_mask is not None:
            kmf = key_mask.to(torch.float32)
            dfk_s = dfk_s * kmf[:, None, :, None]
            dv_s = dv_s * kmf[:, None, :, None]
        dfk += dfk_s
        dv += dv_s
    dg = dgr.sum((0, 2))
    dlf = dlr.sum((0, 2))
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dfq.to(fq.dtype), dfk.to(fk.dtype),
            dg.to(g.dtype), dlf.to(lf.dtype))
