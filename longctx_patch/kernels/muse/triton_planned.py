"""Triton forward and backward kernels of planned MuSe attention (same function as reference.py; the
`autograd.Function` is `ops._MuseFn`).

One program per (query block n, batch x query head) in the forward and in the dq pass, and one per
(key block m, batch x kv head) in the dk/dv pass (FlashAttention-2 layout: the pair (n, m) is recomputed
on each side instead of atomics). Per pair m < n the program
  * computes the super-keys of block m for all q_clusters of block n at once: a [CQ*CK, L] logit tile
    `scale * c_i . k_s` masked to the keys of cell j (row r = i*CK + j), softmax-normalised per row, then
    kt = P @ K and vt = P @ V on the tensor cores;
  * lets every query of block n attend to the CQ*CK super-keys (masked to its own cluster) with logit
    `lse + scale * (q - c) . kt`;
  * attends exactly to the keys of block m when some query cluster of block n retrieved the block or one
    of its cells (skipped otherwise: `ret_any`).
The diagonal block is plain causal attention. All softmax statistics are in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..backend import INTERPRET
from ..triton_lib import dot, online_softmax
from .plan import MusePlan

# dots: fp32 operands with fp32 products ("ieee"), as torch computes fp32 attention (no effect on bf16/fp16);
# UP: the interpreter's bf16 workaround (triton_lib). The online softmax is in base e with the guard for rows
# that have seen no key (a masked tile first).


@triton.jit
def _summaries(cexp, k, v, kv_ok, ka, rj, excl, scale, UP: tl.constexpr):
    """Super-keys of one key block for every (query cluster, key cluster) row of cexp [CC, D]."""
    x = dot(cexp, tl.trans(k), "ieee", UP) * scale  # [CC, L]
    allowed = kv_ok[None, :] & (ka[None, :] == rj[:, None]) & (excl == 0)[:, None]
    x = tl.where(allowed, x, float("-inf"))
    mx = tl.max(x, 1)
    mxs = tl.where(mx == float("-inf"), 0.0, mx)
    p = tl.exp(x - mxs[:, None])
    z = tl.sum(p, 1)
    ne = z > 0
    zs = tl.where(ne, z, 1.0)
    pn = p / zs[:, None]
    kt = dot(pn.to(k.dtype), k, "ieee", UP)  # [CC, D] fp32
    vt = dot(pn.to(v.dtype), v, "ieee", UP)
    lse = mxs + tl.log(zs)
    return pn, kt, vt, lse, ne


@triton.jit
def _load_block(K, V, KA, KVAL, kv_bh, b, m, Sp, offs_l, offs_d, L: tl.constexpr, D: tl.constexpr):
    pos = m * L + offs_l
    k = tl.load(K + (kv_bh * Sp + pos)[:, None] * D + offs_d[None, :])
    v = tl.load(V + (kv_bh * Sp + pos)[:, None] * D + offs_d[None, :])
    ka = tl.load(KA + kv_bh * Sp + pos)
    kv = tl.load(KVAL + b * Sp + pos) != 0
    return k, v, ka, kv


@triton.jit
def _load_queries(Q, QA, CQ, bh, n, NB, Sp, offs_l, offs_d, rr, L: tl.constexpr, D: tl.constexpr,
                  NQ: tl.constexpr, NK: tl.constexpr):
    pos = n * L + offs_l
    q = tl.load(Q + (bh * Sp + pos)[:, None] * D + offs_d[None, :])
    qa = tl.load(QA + bh * Sp + pos)
    cbase = (bh * NB + n) * NQ
    cq = tl.load(CQ + (cbase + qa)[:, None] * D + offs_d[None, :])  # centroid of each query's cluster
    d = (q.to(tl.float32) - cq).to(q.dtype)
    cexp = tl.load(CQ + (cbase + rr // NK)[:, None] * D + offs_d[None, :]).to(q.dtype)  # [CC, D]
    return q, qa, d, cexp


@triton.jit
def _muse_fwd(Q, K, V, KVAL, QA, KA, CQ, RB, RC, ANY, O, LSE, scale, H, HKV, NB, Sp,
              L: tl.constexpr, D: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, UP: tl.constexpr):
    n = NB - 1 - tl.program_id(0)  # longest rows first
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    kv_bh = b * HKV + h // (H // HKV)
    offs_l = tl.arange(0, L)
    offs_d = tl.arange(0, D)
    rr = tl.arange(0, NQ * NK)
    ri = rr // NK
    rj = rr % NK
    q, qa, d, cexp = _load_queries(Q, QA, CQ, bh, n, NB, Sp, offs_l, offs_d, rr, L, D, NQ, NK)
    rb_base = RB + (bh * NB + n) * NQ * NB
    rc_base = RC + (bh * NB + n) * NQ * NB * NK
    any_base = ANY + (bh * NB + n) * NB
    m_i = tl.full([L], float("-inf"), tl.float32)
    l_i = tl.zeros([L], tl.float32)
    acc = tl.zeros([L, D], tl.float32)
    for m in range(0, n):
        k, v, ka, kv = _load_block(K, V, KA, KVAL, kv_bh, b, m, Sp, offs_l, offs_d, L, D)
        if tl.load(any_base + m) != 0:
            s = dot(q, tl.trans(k), "ieee", UP) * scale
            rbq = tl.load(rb_base + qa * NB + m) != 0
            rcq = tl.load(rc_base + (qa[:, None] * NB + m) * NK + ka[None, :]) != 0
            s = tl.where(kv[None, :] & (rbq[:, None] | rcq), s, float("-inf"))
            m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, "ieee", UP, False, True)
        excl = tl.load(rb_base + ri * NB + m) + tl.load(rc_base + (ri * NB + m) * NK + rj)
        pn, kt, vt, lse, ne = _summaries(cexp, k, v, kv, ka, rj, excl, scale, UP)
        y = dot(d, tl.trans(kt.to(q.dtype)), "ieee", UP) * scale + lse[None, :]
        y = tl.where((qa[:, None] == ri[None, :]) & ne[None, :], y, float("-inf"))
        m_i, l_i, acc = online_softmax(y, vt.to(q.dtype), m_i, l_i, acc, "ieee", UP, False, True)
    k, v, ka, kv = _load_block(K, V, KA, KVAL, kv_bh, b, n, Sp, offs_l, offs_d, L, D)
    s = dot(q, tl.trans(k), "ieee", UP) * scale
    s = tl.where(kv[None, :] & (offs_l[None, :] <= offs_l[:, None]), s, float("-inf"))
    m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, "ieee", UP, False, True)
    ok = l_i > 0
    ls = tl.where(ok, l_i, 1.0)
    out = acc / ls[:, None]
    pos = n * L + offs_l
    tl.store(O + (bh * Sp + pos)[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty))
    tl.store(LSE + bh * Sp + pos, tl.where(ok, m_i + tl.log(ls), 0.0))


@triton.jit
def _bwd_contrib_dq(s, keys, vals, do, lse_r, delta, dq, UP: tl.constexpr):
    p = tl.exp(s - lse_r[:, None])
    dp = dot(do, tl.trans(vals), "ieee", UP)
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.to(keys.dtype), keys, "ieee", UP)


@triton.jit
def _muse_bwd_dq(Q, K, V, KVAL, QA, KA, CQ, RB, RC, ANY, DO, LSE, DELTA, DQ, scale, H, HKV, NB, Sp,
                 L: tl.constexpr, D: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, UP: tl.constexpr):
    n = NB - 1 - tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    kv_bh = b * HKV + h // (H // HKV)
    offs_l = tl.arange(0, L)
    offs_d = tl.arange(0, D)
    rr = tl.arange(0, NQ * NK)
    ri = rr // NK
    rj = rr % NK
    q, qa, d, cexp = _load_queries(Q, QA, CQ, bh, n, NB, Sp, offs_l, offs_d, rr, L, D, NQ, NK)
    pos = n * L + offs_l
    do = tl.load(DO + (bh * Sp + pos)[:, None] * D + offs_d[None, :])
    lse_r = tl.load(LSE + bh * Sp + pos)
    delta = tl.load(DELTA + bh * Sp + pos)
    rb_base = RB + (bh * NB + n) * NQ * NB
    rc_base = RC + (bh * NB + n) * NQ * NB * NK
    any_base = ANY + (bh * NB + n) * NB
    dq = tl.zeros([L, D], tl.float32)
    for m in range(0, n):
        k, v, ka, kv = _load_block(K, V, KA, KVAL, kv_bh, b, m, Sp, offs_l, offs_d, L, D)
        if tl.load(any_base + m) != 0:
            s = dot(q, tl.trans(k), "ieee", UP) * scale
            rbq = tl.load(rb_base + qa * NB + m) != 0
            rcq = tl.load(rc_base + (qa[:, None] * NB + m) * NK + ka[None, :]) != 0
            s = tl.where(kv[None, :] & (rbq[:, None] | rcq), s, float("-inf"))
            dq = _bwd_contrib_dq(s, k, v, do, lse_r, delta, dq, UP)
        excl = tl.load(rb_base + ri * NB + m) + tl.load(rc_base + (ri * NB + m) * NK + rj)
        pn, kt, vt, lse, ne = _summaries(cexp, k, v, kv, ka, rj, excl, scale, UP)
        y = dot(d, tl.trans(kt.to(q.dtype)), "ieee", UP) * scale + lse[None, :]
        y = tl.where((qa[:, None] == ri[None, :]) & ne[None, :], y, float("-inf"))
        dq = _bwd_contrib_dq(y, kt.to(q.dtype), vt.to(q.dtype), do, lse_r, delta, dq, UP)
    k, v, ka, kv = _load_block(K, V, KA, KVAL, kv_bh, b, n, Sp, offs_l, offs_d, L, D)
    s = dot(q, tl.trans(k), "ieee", UP) * scale
    s = tl.where(kv[None, :] & (offs_l[None, :] <= offs_l[:, None]), s, float("-inf"))
    dq = _bwd_contrib_dq(s, k, v, do, lse_r, delta, dq, UP)
    tl.store(DQ + (bh * Sp + pos)[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty))


@triton.jit
def _bwd_exact_dkdv(s, q, v, do, lse_r, delta, dk, dv, scale, UP: tl.constexpr):
    p = tl.exp(s - lse_r[:, None])  # rows with nothing allowed give p = 0
    dv += dot(tl.trans(p.to(do.dtype)), do, "ieee", UP)
    dp = dot(do, tl.trans(v), "ieee", UP)
    ds = p * (dp - delta[:, None])
    dk += dot(tl.trans(ds.to(q.dtype)), q, "ieee", UP) * scale
    return dk, dv


@triton.jit
def _muse_bwd_dkdv(Q, K, V, KVAL, QA, KA, CQ, RB, RC, ANY, DO, LSE, DELTA, DK, DV, scale, H, HKV, NB, Sp,
                   L: tl.constexpr, D: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, UP: tl.constexpr):
    m = tl.program_id(0)
    kv_bh = tl.program_id(1).to(tl.int64)
    b = kv_bh // HKV
    g = kv_bh % HKV
    GRP = H // HKV
    offs_l = tl.arange(0, L)
    offs_d = tl.arange(0, D)
    rr = tl.arange(0, NQ * NK)
    ri = rr // NK
    rj = rr % NK
    k, v, ka, kv = _load_block(K, V, KA, KVAL, kv_bh, b, m, Sp, offs_l, offs_d, L, D)
    dk = tl.zeros([L, D], tl.float32)
    dv = tl.zeros([L, D], tl.float32)
    for hh in range(0, GRP):
        bh = b * H + g * GRP + hh
        for n in range(m, NB):
            q, qa, d, cexp = _load_queries(Q, QA, CQ, bh, n, NB, Sp, offs_l, offs_d, rr, L, D, NQ, NK)
            pos = n * L + offs_l
            do = tl.load(DO + (bh * Sp + pos)[:, None] * D + offs_d[None, :])
            lse_r = tl.load(LSE + bh * Sp + pos)
            delta = tl.load(DELTA + bh * Sp + pos)
            rb_base = RB + (bh * NB + n) * NQ * NB
            rc_base = RC + (bh * NB + n) * NQ * NB * NK
            if n == m:
                s = dot(q, tl.trans(k), "ieee", UP) * scale
                s = tl.where(kv[None, :] & (offs_l[None, :] <= offs_l[:, None]), s, float("-inf"))
                dk, dv = _bwd_exact_dkdv(s, q, v, do, lse_r, delta, dk, dv, scale, UP)
            elif tl.load(ANY + (bh * NB + n) * NB + m) != 0:  # some cluster of block n retrieved block m
                s = dot(q, tl.trans(k), "ieee", UP) * scale
                rbq = tl.load(rb_base + qa * NB + m) != 0
                rcq = tl.load(rc_base + (qa[:, None] * NB + m) * NK + ka[None, :]) != 0
                s = tl.where(kv[None, :] & (rbq[:, None] | rcq), s, float("-inf"))
                dk, dv = _bwd_exact_dkdv(s, q, v, do, lse_r, delta, dk, dv, scale, UP)
            if n != m:
                excl = tl.load(rb_base + ri * NB + m) + tl.load(rc_base + (ri * NB + m) * NK + rj)
                pn, kt, vt, lse, ne = _summaries(cexp, k, v, kv, ka, rj, excl, scale, UP)
                y = dot(d, tl.trans(kt.to(q.dtype)), "ieee", UP) * scale + lse[None, :]
                y = tl.where((qa[:, None] == ri[None, :]) & ne[None, :], y, float("-inf"))
                py = tl.exp(y - lse_r[:, None])  # [L, CC]
                dpy = dot(do, tl.trans(vt.to(do.dtype)), "ieee", UP)
                dy = py * (dpy - delta[:, None])
                dvt = dot(tl.trans(py.to(do.dtype)), do, "ieee", UP)  # [CC, D]
                dkt = dot(tl.trans(dy.to(d.dtype)), d, "ieee", UP) * scale  # [CC, D]
                dlse = tl.sum(dy, 0)  # [CC]
                kdk = dot(dkt, tl.trans(k.to(tl.float32)), "ieee", UP)  # [CC, L]
                vdv = dot(dvt, tl.trans(v.to(tl.float32)), "ieee", UP)
                gu = pn * (dlse[:, None] + kdk - tl.sum(kt * dkt, 1)[:, None] + vdv - tl.sum(vt * dvt, 1)[:, None])
                pnt = tl.trans(pn.to(q.dtype))
                dv += dot(pnt, dvt.to(q.dtype), "ieee", UP)
                dk += dot(pnt, dkt.to(q.dtype), "ieee", UP) + dot(tl.trans(gu.to(q.dtype)), cexp, "ieee", UP) * scale
    pos = m * L + offs_l
    tl.store(DK + (kv_bh * Sp + pos)[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty))
    tl.store(DV + (kv_bh * Sp + pos)[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty))


def _pad(x: torch.Tensor, Sp: int) -> torch.Tensor:
    S = x.shape[2]
    if Sp != S:
        x = torch.nn.functional.pad(x, (0, 0, 0, Sp - S))
    return x.contiguous()


def _tables(plan: MusePlan):
    i8 = torch.int8
    return (
        plan.key_valid.to(i8).contiguous(),
        plan.q_assign.contiguous(),
        plan.k_assign.contiguous(),
        plan.q_centroids.float().contiguous(),
        plan.ret_block.to(i8).contiguous(),
        plan.ret_cell.to(i8).contiguous(),
        plan.ret_any.to(i8).contiguous(),
    )


def _launch_cfg(L: int, D: int, dtype: torch.dtype, stages: int = 2):
    return dict(UP=INTERPRET and dtype != torch.float32, num_warps=4 if L * D <= 64 * 64 else 8, num_stages=stages)


_STAGES_OK: dict = {}


def _launch(kernel, grid, args, L: int, D: int, dtype: torch.dtype, stages: int = 2):
    """Launches with `stages` software-pipelining stages (one for 128 x 128 block tiles: the configuration
    measured on the H200), falling back to 1 when shared memory is too small."""
    stages = stages if L * D <= 64 * 128 else 1
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), L, D, dtype, stages)
    st = _STAGES_OK.get(key, stages)
    try:
        kernel[grid](*args, **_launch_cfg(L, D, dtype, st))
    except OutOfResources:
        if st == 1:
            raise
        kernel[grid](*args, **_launch_cfg(L, D, dtype, 1))
        st = 1
    _STAGES_OK[key] = st


def muse_fwd(q, k, v, plan: MusePlan, scale: float):
    """The forward kernel: o [B, H, Sp, D] (padded to the plan's blocks), and what `muse_bwd` takes (the saved
    tensors, the sizes)."""
    B, H, S, D = q.shape
    HKV = k.shape[1]
    L, NB, Sp = plan.block_size, plan.num_blocks, plan.padded_len
    NQ, NK = plan.q_centroids.shape[3], plan.ret_cell.shape[-1]
    qp, kp, vp = _pad(q, Sp), _pad(k, Sp), _pad(v.to(q.dtype), Sp)
    tabs = _tables(plan)
    o = torch.empty_like(qp)
    lse = torch.empty(B, H, Sp, device=q.device, dtype=torch.float32)
    _launch(_muse_fwd, (NB, B * H), (qp, kp, vp, *tabs, o, lse, float(scale), H, HKV, NB, Sp, L, D, NQ, NK),
            L, D, q.dtype)
    return o, (qp, kp, vp, o, lse, *tabs), (scale, S, L, NB, Sp, NQ, NK, k.dtype, v.dtype)


def muse_bwd(saved, meta, do):
    """The backward kernels (dq; dk and dv) from `muse_fwd`'s saved tensors and sizes: (dq, dk, dv) of the inputs."""
    qp, kp, vp, o, lse, *tabs = saved
    scale, S, L, NB, Sp, NQ, NK, kdt, vdt = meta
    B, H, _, D = qp.shape
    HKV = kp.shape[1]
    dop = _pad(do.to(qp.dtype), Sp)
    delta = (dop.float() * o.float()).sum(-1).contiguous()
    dq = torch.empty_like(qp)
    dk = torch.empty_like(kp)
    dv = torch.empty_like(vp)
    _launch(_muse_bwd_dq, (NB, B * H),
            (qp, kp, vp, *tabs, dop, lse, delta, dq, float(scale), H, HKV, NB, Sp, L, D, NQ, NK), L, D, qp.dtype)
    # one stage: with two, Triton 3.6 produced wrong dk on an H200 (the CPU interpreter was right)
    _launch(_muse_bwd_dkdv, (NB, B * HKV),
            (qp, kp, vp, *tabs, dop, lse, delta, dk, dv, float(scale), H, HKV, NB, Sp, L, D, NQ, NK), L, D,
            qp.dtype, stages=1)
    return dq[:, :, :S], dk[:, :, :S].to(kdt), dv[:, :, :S].to(vdt)
