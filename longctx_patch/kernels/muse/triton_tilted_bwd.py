"""The Triton backward of MuSe's tilted-cells far field (`triton_tilted.py` has the forward, docs/muse.md section 8
the derivation). Imported only when the Triton backend runs.

With P the probabilities at the merged log-sum-exp and dS = P (dO.v - Delta), Delta = rowsum(dO * O) of the merged
output, the exact part's gradients are the cells kernels' without a far field (`cells_bwd_qkv` on the merged O and
LSE). A far super-key of query t (cluster c, cell (m, j)) has logit lse + scale (q_t - c).kt and value vt, so

    dq_t += scale sum dS kt        dkt = scale sum_t dS (q_t - c)     dvt = sum_t P dO_t     dlse = sum_t dS

(`_tilt_far_dq` over the queries sorted by cluster; `_tilt_far_dsumm` per cluster and tile of cells, over the
cluster's rows that see them). The summary of cell S at c is a softmax of a_s = scale c.k_s (w_s its weights):
lse = logsumexp a, kt = sum w k, vt = sum w v, so with A = dlse - dkt.kt - dvt.vt

    dL/da_s = w_s (A + dkt.k_s + dvt.v_s)     dk_s += w_s dkt + scale c dL/da_s     dv_s += w_s dvt

summed over every centroid of every query head of the kv head (`_tilt_summaries_bwd`, per block and kv head, over
its keys sorted by cell). The centroids, the cells and the retrieval are the plan's: constants, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_lib import dot
from .support import DEFAULT_TILES, MuseTiles
from .triton_cells import bwd_inputs, cells_bwd_qkv
from .triton_tilted import cluster_rows_tilt, far_load, far_logits, head_chunk, sorted_rows, summaries, tilted_tiles


@triton.jit
def _tilt_far_dq(Q, ORD, SCL, C, LSE, KT, VT, RET, DO, LSEM, DELTA, DQ, scale, H, H0, HC, NB, NW, Sp, NCK, CQ,
                 L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, UP: tl.constexpr):
    """Program (tile of BM queries in sorted order, batch x query head, as `_tilt_far_fwd`): the far field's part of
    dq, added to DQ (float32) at the rows' positions."""
    lh, bh, pos, cl, n, q = sorted_rows(Q, ORD, SCL, H, H0, HC, Sp, L, D, BM)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    do = tl.load(DO + (bh * Sp + pos)[:, None] * D + offs_d[None, :])
    lse2 = tl.load(LSEM + bh * Sp + pos) * 1.4426950408889634
    delta = tl.load(DELTA + bh * Sp + pos)
    qk = scale * 1.4426950408889634
    dq = tl.zeros([BM, D], tl.float32)
    c_lo = tl.min(cl, 0)
    c_hi = tl.max(tl.where(cl < CQ, cl, -1), 0)
    for c in range(c_lo, c_hi + 1):
        rows, d, hi, base = cluster_rows_tilt(C, KT, q, cl, n, c, lh, bh, NCK, CQ, CK, LOC, D)
        for j0 in range(0, hi, BN):
            cidx = j0 + offs_n
            kt, vt, lse = far_load(KT, VT, LSE, base, cidx, cidx < hi, offs_d, D)
            s = far_logits(d, kt, lse, RET, rows, n, bh, j0, cidx, NB, NW, scale, CK, BN, UP)
            p = tl.exp2(s * qk - lse2[:, None])
            ds = p * (dot(do, tl.trans(vt), "tf32x3", UP) - delta[:, None])
            dq += dot(ds.to(kt.dtype), kt, "tf32x3", UP)
    real = (cl < CQ)[:, None]
    ptr = DQ + (bh * Sp + pos)[:, None] * D + offs_d[None, :]
    tl.store(ptr, tl.load(ptr, mask=real, other=0.0) + dq * scale, mask=real)


@triton.jit
def _tilt_far_dsumm(Q, ORD, FIRST, C, LSE, KT, VT, RET, DO, LSEM, DELTA, DKT, DVT, A, scale, H, H0, HC, NB, NW, Sp,
                    NCK, CQ, L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, D: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr):
    """Program (tile of BN cells, cluster c, batch x query head): dkt, dvt of the cluster's summaries of those cells
    and A = dlse - dkt.kt - dvt.vt, over the cluster's rows after the tile's first block + LOC (FIRST: the sorted
    row where cluster c's queries of block n begin, n = 0 .. NB)."""
    j0 = tl.program_id(0) * BN
    c = tl.program_id(1)
    lh = tl.program_id(2).to(tl.int64)
    bh = (lh // HC) * H + H0 + lh % HC
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BM)
    cidx = j0 + tl.arange(0, BN)
    inb = cidx < NCK
    base = (lh * CQ + c) * NCK
    frow = (bh * CQ + c) * (NB + 1)
    r0 = tl.load(FIRST + frow + tl.minimum(j0 // CK + LOC + 1, NB))
    r1 = tl.load(FIRST + frow + NB)
    kt, vt, lse = far_load(KT, VT, LSE, base, cidx, inb, offs_d, D)
    cen = tl.load(C + (bh * CQ + c) * D + offs_d).to(tl.float32)
    qk = scale * 1.4426950408889634
    dkt = tl.zeros([BN, D], tl.float32)
    dvt = tl.zeros([BN, D], tl.float32)
    dls = tl.zeros([BN], tl.float32)
    for r in range(r0, r1, BM):
        rows = r + offs_m < r1
        pos = tl.load(ORD + bh * Sp + r + offs_m, mask=rows, other=0).to(tl.int64)
        n = (pos // L).to(tl.int32)
        q = tl.load(Q + (bh * Sp + pos)[:, None] * D + offs_d[None, :], mask=rows[:, None], other=0.0)
        do = tl.load(DO + (bh * Sp + pos)[:, None] * D + offs_d[None, :], mask=rows[:, None], other=0.0)
        lse2 = tl.load(LSEM + bh * Sp + pos, mask=rows, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + bh * Sp + pos, mask=rows, other=0.0)
        d = (q.to(tl.float32) - cen[None, :]).to(KT.dtype.element_ty)
        s = far_logits(d, kt, lse, RET, rows, n, bh, j0, cidx, NB, NW, scale, CK, BN, UP)
        p = tl.exp2(s * qk - lse2[:, None])
        ds = p * (dot(do, tl.trans(vt), "tf32x3", UP) - delta[:, None])
        dvt += dot(tl.trans(p.to(do.dtype)), do, "tf32x3", UP)
        dkt += dot(tl.trans(ds.to(d.dtype)), d, "tf32x3", UP)
        dls += tl.sum(ds, 0)
    dkt = dkt * scale
    a = dls - tl.sum(dkt * kt.to(tl.float32), 1) - tl.sum(dvt * vt.to(tl.float32), 1)
    tl.store(DKT + (base + cidx)[:, None] * D + offs_d[None, :], dkt.to(DKT.dtype.element_ty), mask=inb[:, None])
    tl.store(DVT + (base + cidx)[:, None] * D + offs_d[None, :], dvt.to(DVT.dtype.element_ty), mask=inb[:, None])
    tl.store(A + base + cidx, a, mask=inb)


@triton.jit
def _tilt_summaries_bwd(K, V, KORD, CST, C, LSE, DKT, DVT, A, DK, DV, scale, H, HKV, H0, HC, HK0, NHK, Sp, NB, NCK,
                        CQ, L: tl.constexpr, CK: tl.constexpr, D: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                        UP: tl.constexpr):
    """Program (block m, batch x kv head HK0 .. HK0 + NHK - 1): the summaries' part of dk, dv of the block's keys, per
    chunk of BK keys of one cell (sorted by cell, as `_tilt_summaries`), summed over every centroid of the kv head's
    query heads in the chunk H0 .. H0 + HC - 1; added to DK, DV (float32)."""
    m = tl.program_id(0)
    lk = tl.program_id(1).to(tl.int64)
    b = lk // NHK
    hk = HK0 + lk % NHK
    bkv = b * HKV + hk
    G = H // HKV
    g_lo = tl.maximum(H0 - hk * G, 0)
    g_hi = tl.minimum(H0 + HC - hk * G, G)
    offs_k = tl.arange(0, BK)
    offs_d = tl.arange(0, D)
    offs_c = tl.arange(0, BC)
    qk = scale * 1.4426950408889634
    for j in range(CK):
        s0 = tl.load(CST + (bkv * NB + m) * (CK + 1) + j)
        s1 = tl.load(CST + (bkv * NB + m) * (CK + 1) + j + 1)
        for k0 in range(s0, s1, BK):
            inb = k0 + offs_k < s1
            pos = m * L + tl.load(KORD + bkv * Sp + m * L + k0 + offs_k, mask=inb, other=0)
            k = tl.load(K + (bkv * Sp + pos)[:, None] * D + offs_d[None, :], mask=inb[:, None], other=0.0)
            v = tl.load(V + (bkv * Sp + pos)[:, None] * D + offs_d[None, :], mask=inb[:, None], other=0.0)
            dk = tl.zeros([BK, D], tl.float32)
            dv = tl.zeros([BK, D], tl.float32)
            for g in range(g_lo, g_hi):
                h = hk * G + g
                bh = b * H + h
                lh = b * HC + h - H0
                for c0 in range(0, CQ, BC):
                    cc = c0 + offs_c
                    cm = cc < CQ
                    row = (lh * CQ + cc) * NCK + m * CK + j
                    c = tl.load(C + (bh * CQ + cc)[:, None] * D + offs_d[None, :], mask=cm[:, None], other=0.0)
                    lse2 = tl.load(LSE + row, mask=cm, other=0.0) * 1.4426950408889634
                    dkt = tl.load(DKT + row[:, None] * D + offs_d[None, :], mask=cm[:, None], other=0.0)
                    dvt = tl.load(DVT + row[:, None] * D + offs_d[None, :], mask=cm[:, None], other=0.0)
                    a = tl.load(A + row, mask=cm, other=0.0)
                    x = dot(c, tl.trans(k), "tf32x3", UP)
                    w = tl.where(cm[:, None] & inb[None, :], tl.exp2(x * qk - lse2[:, None]), 0.0)  # [BC, BK]
                    gm = w * (a[:, None] + dot(dkt, tl.trans(k), "tf32x3", UP) + dot(dvt, tl.trans(v), "tf32x3", UP))
                    dk += dot(tl.trans(w.to(dkt.dtype)), dkt, "tf32x3", UP)
                    dk += scale * dot(tl.trans(gm.to(c.dtype)), c, "tf32x3", UP)
                    dv += dot(tl.trans(w.to(dvt.dtype)), dvt, "tf32x3", UP)
            pk = DK + (bkv * Sp + pos)[:, None] * D + offs_d[None, :]
            tl.store(pk, tl.load(pk, mask=inb[:, None], other=0.0) + dk, mask=inb[:, None])
            pv = DV + (bkv * Sp + pos)[:, None] * D + offs_d[None, :]
            tl.store(pv, tl.load(pv, mask=inb[:, None], other=0.0) + dv, mask=inb[:, None])


def tilted_bwd_tiles(D: int, dtype: torch.dtype, tiles: MuseTiles = DEFAULT_TILES) -> dict:
    """Launch tiles of the backward: dq (BM, BN, warps), dsumm (BM rows, BN cells, warps), summaries' backward
    (centroids BC, keys BK, warps); `tiles.tilted_dq` / `tilted_dsumm` / `tilted_sbwd` replace them (benchmarks'
    sweeps)."""
    wide = D >= 128 or dtype == torch.float32  # the fastest of an H200 sweep at 64k (bench_muse_tilted bwd_profile)
    far = (64, 32 if wide else 64, 4)
    return dict(dq=tiles.tilted_dq or far, dsumm=tiles.tilted_dsumm or far, sbwd=tiles.tilted_sbwd or (32, 32, 4))


def cluster_row_starts(scl: torch.Tensor, order: torch.Tensor, Cq: int, nb: int, L: int) -> torch.Tensor:
    """[B * Hq, Cq, nb + 1] int32: the first row, in the sorted order, of cluster c's queries at positions >= n L
    (n = nb: the row after the cluster's last). scl, order [B, Hq, Sp]: the sorted rows' clusters and positions."""
    B, Hq, Sp = order.shape
    skey = (scl.long() * Sp + order.long()).view(B * Hq, Sp)  # ascending: the sort's key
    ar = torch.arange(Cq, device=order.device)[:, None] * Sp + torch.arange(nb + 1, device=order.device)[None] * L
    first = torch.searchsorted(skey, ar.view(1, -1).expand(B * Hq, -1).contiguous())
    return first.to(torch.int32).view(B * Hq, Cq, nb + 1).contiguous()


def tilted_cells_bwd(saved, meta, do):
    """dq, dk, dv (the inputs' dtype) from `tilted_cells_forward`'s saved tensors and sizes and do [B, S, Hq, D], with
    the forward's tiles."""
    cmeta, ncs, Ck, Cq, summary_bytes, tiles = meta
    cs = saved[:ncs]
    korder, cstart, C, order, scl, ret = saved[ncs:]
    Q, K, V, O, LSEM = cs[0], cs[1], cs[2], cs[5], cs[6]
    B, Hq, Hkv, S, D, L, _, nb, Sp, loc, _, _, up, scale, _ = cmeta
    G = Hq // Hkv
    DO, DELTA = bwd_inputs(do, O)
    DQ, DK, DV = cells_bwd_qkv(cs, cmeta, DO, DELTA)
    first = cluster_row_starts(scl, order, Cq, nb, L)
    NCK = nb * Ck
    t, tb = tilted_tiles(D, Q.dtype, tiles), tilted_bwd_tiles(D, Q.dtype, tiles)
    qm, qn, qw = tb["dq"]
    sm, sn, sw = tb["dsumm"]
    bc, bk, bw = tb["sbwd"]
    qn, sn = min(qn, 32 * Ck), min(sn, 32 * Ck)  # a tile's cells span at most 32 blocks (`far_logits`)
    hc = head_chunk(B, Hq, Cq, NCK, D, Q.element_size(), summary_bytes, arrays=2)
    dev = Q.device
    LSE = torch.empty(B * hc, Cq, NCK, device=dev, dtype=torch.float32)
    KT = torch.empty(B * hc, Cq, NCK, D, device=dev, dtype=Q.dtype)
    VT, DKT, DVT = torch.empty_like(KT), torch.empty_like(KT), torch.empty_like(KT)
    A = torch.empty_like(LSE)
    nw = ret.shape[-1]
    for h0 in range(0, Hq, hc):
        n = min(hc, Hq - h0)
        summaries(K, V, korder, cstart, C, LSE, KT, VT, scale, h0, n, (B, Hq, Hkv, Sp, nb, Ck, Cq, L, D), up,
                  t["summ"])
        _tilt_far_dq[(Sp // qm, B * n)](
            Q, order, scl, C, LSE, KT, VT, ret, DO, LSEM, DELTA, DQ, scale, Hq, h0, n, nb, nw, Sp, NCK, Cq,
            L=L, CK=Ck, LOC=loc, D=D, BM=qm, BN=qn, UP=up, num_warps=qw)
        _tilt_far_dsumm[(triton.cdiv(NCK, sn), Cq, B * n)](
            Q, order, first, C, LSE, KT, VT, ret, DO, LSEM, DELTA, DKT, DVT, A, scale, Hq, h0, n, nb, nw, Sp, NCK,
            Cq, L=L, CK=Ck, LOC=loc, D=D, BM=sm, BN=sn, UP=up, num_warps=sw)
        hk0, hk1 = h0 // G, (h0 + n - 1) // G
        _tilt_summaries_bwd[(nb, B * (hk1 - hk0 + 1))](
            K, V, korder, cstart, C, LSE, DKT, DVT, A, DK, DV, scale, Hq, Hkv, h0, n, hk0, hk1 - hk0 + 1, Sp, nb,
            NCK, Cq, L=L, CK=Ck, D=D, BC=bc, BK=bk, UP=up, num_warps=bw)
    return tuple(g[:, :, :S].to(Q.dtype) for g in (DQ, DK, DV))
