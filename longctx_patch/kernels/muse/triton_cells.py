"""The Triton kernels of MuSe's cells far field (`reference_cells.py` has the plan, the reference and the design): the forward
and backward kernels, their tiles and launches (the `autograd.Function` is `ops._CellsAttention`). Imported only
when the Triton backend runs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import dot, online_softmax_scaled
from .reference_cells import CellsPlan
from .plan import log_counts
from .support import DEFAULT_TILES, MuseTiles

# dots at "tf32x3": bf16/fp16 operands, one tensor-core dot; fp32 operands, each split in a tf32 high part and a
# tf32 remainder (three tensor-core products), within a few fp32 ulps of ieee products (ieee fp32 dots compile to
# FMA loops that spill on sm_90). UP: the interpreter's bf16 workaround (triton_lib). The online softmax takes the
# unscaled logits (online_softmax_scaled: scale and max subtraction in one FMA); its EMPTY flag: a row of the tile
# may be all -inf with no earlier finite logit (a masked tile); without it the max is finite and needs no guard.


@triton.jit
def _cell_tile(MU, VB, LOGN, RET, q, scale, bh, kvh, n, NB, NCK, c0, hi, offs_n, offs_d, CK: tl.constexpr,
               D: tl.constexpr, UP: tl.constexpr):
    """Cells c0 .. c0 + BN of the far field of query block n (cells of blocks < n - LOC: `hi`; retrieved blocks
    masked): mean keys, mean values and the unscaled logits of the query tile q (`q.mu + log n / scale`, the
    callers multiply by scale; -inf where masked or empty)."""
    cidx = c0 + offs_n
    ok = cidx < hi
    ok = ok & (tl.load(RET + (bh * NB + n) * NB + cidx // CK, mask=ok, other=1) == 0)
    mu = tl.load(MU + (kvh * NCK + cidx)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    vb = tl.load(VB + (kvh * NCK + cidx)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    bias = tl.load(LOGN + kvh * NCK + cidx, mask=ok, other=float("-inf")) / scale
    return mu, vb, dot(q, tl.trans(mu), "tf32x3", UP) + bias[None, :]


@triton.jit
def _exact_tile(K, V, KVAL, q, b, kvh, Sp, pos0, offs_m, offs_n, offs_d, MASK: tl.constexpr, D: tl.constexpr,
                UP: tl.constexpr):
    """Exact keys pos0 .. pos0 + BN: keys, values and the unscaled logits q.k of the query tile q. MASK 0: none
    (full earlier blocks without a key mask), 1: -inf for padding, 2: also for keys after the query (own block)."""
    pos = pos0 + offs_n
    k = tl.load(K + (kvh * Sp + pos)[:, None] * D + offs_d[None, :])
    v = tl.load(V + (kvh * Sp + pos)[:, None] * D + offs_d[None, :])
    s = dot(q, tl.trans(k), "tf32x3", UP)
    if MASK > 0:
        ok = (tl.load(KVAL + b * Sp + pos) != 0)[None, :]
        if MASK == 2:
            ok = ok & (pos[None, :] <= offs_m[:, None])
        s = tl.where(ok, s, float("-inf"))
    return k, v, s


@triton.jit
def _list_len(EXL, row, NE: tl.constexpr, NEP: tl.constexpr):
    """Number of blocks in row `row` of `exact_lists` (its valid entries come first)."""
    e = tl.arange(0, NEP)
    return tl.sum((tl.load(EXL + row * NE + e, mask=e < NE, other=-1) >= 0).to(tl.int32), 0)


@triton.jit
def _cells_fwd(Q, K, V, MU, VB, LOGN, KVAL, EXL, RET, O, LSE, scale, H, HKV, NB, Sp, NCK,
               L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, NE: tl.constexpr, NEP: tl.constexpr,
               PAD: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr,
               FAR: tl.constexpr):
    # programs run in launch order, axis 0 fastest: the longest (last) query tiles of every head start first
    bh = tl.program_id(0).to(tl.int64)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = b * HKV + h // (H // HKV)
    offs_m = tile * BM + tl.arange(0, BM)
    n = (tile * BM) // L  # the query block (BM divides L)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    q = tl.load(Q + (bh * Sp + offs_m)[:, None] * D + offs_d[None, :])
    qk = scale * 1.4426950408889634  # logits in the log2 domain
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    # far field (FAR; without it, the listed blocks alone): the cells of blocks 0 .. n - LOC - 1, minus the retrieved
    if FAR:
        hi = tl.maximum(n - LOC, 0) * CK
        for c0 in range(0, hi, BN):
            _, vb, s = _cell_tile(MU, VB, LOGN, RET, q, scale, bh, kvh, n, NB, NCK, c0, hi, offs_n, offs_d, CK, D, UP)
            m_i, l_i, acc = online_softmax_scaled(s, qk, vb, m_i, l_i, acc, "tf32x3", UP, True)
    # exact: the listed earlier blocks (retrieved and local), one flat loop over (block, key tile) so that the
    # loads pipeline across blocks; then the own block up to the tile's last query, causally
    row = bh * NB + n
    for it in range(0, _list_len(EXL, row, NE, NEP) * (L // BN)):
        mblk = tl.load(EXL + row * NE + it // (L // BN))
        _, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, mblk * L + (it % (L // BN)) * BN, offs_m, offs_n, offs_d,
                              PAD, D, UP)
        m_i, l_i, acc = online_softmax_scaled(s, qk, v, m_i, l_i, acc, "tf32x3", UP, PAD > 0)
    for k0 in range(0, (tile * BM) % L + BM, BN):
        _, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, n * L + k0, offs_m, offs_n, offs_d, 2, D, UP)
        m_i, l_i, acc = online_softmax_scaled(s, qk, v, m_i, l_i, acc, "tf32x3", UP, True)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + (bh * Sp + offs_m)[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty))
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = (m_fin + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453  # natural log, for the backward
    tl.store(LSE + bh * Sp + offs_m, tl.where(has, lse, 0.0))


def exact_lists(plan: CellsPlan) -> torch.Tensor:
    """[B, Hq, nb, topk + sinks + local] int32: the earlier blocks each query block attends exactly, first in each row;
    -1 pads the rest (the kernels count a row's blocks and loop over them only)."""
    R = plan.retrieved.clone()
    nb, loc = plan.num_blocks, plan.local_blocks
    ar = torch.arange(nb, device=R.device)
    R |= ((ar[None, :] < ar[:, None]) & (ar[None, :] >= ar[:, None] - loc))[None, None]
    NE = max(1, min(nb, plan.max_retrieved + loc))  # static: no device-to-host copy
    val, idx = R.to(torch.int8).topk(NE, dim=-1, sorted=True)  # the True blocks first
    return torch.where(val > 0, idx, torch.full_like(idx, -1)).to(torch.int32).contiguous()


READERS_CHUNK = 32  # (query head, query block) pairs per program of the dK/dV kernel


def exact_readers(retrieved: torch.Tensor, local_blocks: int, Hkv: int, chunk_elems: int = 1 << 26):
    """The transpose of `exact_lists` per kv head: for each key block m, the (query head g of the kv head's group,
    query block n) pairs that attend it exactly (retrieved, local, or its own block), as g * nb + n in ascending order:
    [B, Hkv, nb, G * nb + 1] int32 (the last column a scratch slot) and their counts [B, Hkv, nb] int32. Built for
    as many batch rows at a time as keep the int64 slots within `chunk_elems` elements (at least one row)."""
    R = retrieved != 0  # [B, Hq, n, m]
    B, Hq, nb, _ = R.shape
    G = Hq // Hkv
    ar = torch.arange(nb, device=R.device)
    band = (ar[None, :] <= ar[:, None]) & (ar[None, :] >= ar[:, None] - local_blocks)  # [n, m]: own and local
    out = torch.full((B, Hkv, nb, G * nb + 1), -1, dtype=torch.int32, device=R.device)
    cnt = torch.empty(B, Hkv, nb, dtype=torch.int32, device=R.device)
    entries = torch.arange(G * nb, device=R.device, dtype=torch.int32)
    rows = max(1, chunk_elems // (Hq * nb * nb))
    for b0 in range(0, B, rows):
        b1 = min(B, b0 + rows)
        T = (R[b0:b1] | band).view(b1 - b0, Hkv, G, nb, nb).permute(0, 1, 4, 2, 3).reshape(b1 - b0, Hkv, nb, G * nb)
        cnt[b0:b1] = T.sum(-1, dtype=torch.int32)  # T: [rows, kv, m, g * nb + n]
        slot = torch.where(T, T.cumsum(-1) - 1, G * nb)
        out[b0:b1].scatter_(-1, slot, entries.expand_as(slot))
    return out, cnt


@triton.jit
def _p_ds(s, qk, lse2, do, vals, delta, UP: tl.constexpr):
    """Row-major pair [BM queries, BN keys] of unscaled logits s: probabilities and dS = P * (dO V^T - Delta)."""
    p = tl.exp2(s * qk - lse2[:, None])
    dp = dot(do, tl.trans(vals), "tf32x3", UP)
    return p, p * (dp - delta[:, None])


@triton.jit
def _cells_bwd_dq(Q, K, V, MU, VB, LOGN, KVAL, EXL, RET, DO, LSE, DELTA, DQ, scale, H, HKV, NB, Sp, NCK,
                  L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, NE: tl.constexpr, NEP: tl.constexpr,
                  PAD: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr,
                  FAR: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    kvh = b * HKV + h // (H // HKV)
    offs_m = tile * BM + tl.arange(0, BM)
    n = (tile * BM) // L
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    qk = scale * 1.4426950408889634
    q = tl.load(Q + (bh * Sp + offs_m)[:, None] * D + offs_d[None, :])
    do = tl.load(DO + (bh * Sp + offs_m)[:, None] * D + offs_d[None, :])
    lse2 = tl.load(LSE + bh * Sp + offs_m) * 1.4426950408889634
    delta = tl.load(DELTA + bh * Sp + offs_m)
    dq = tl.zeros([BM, D], tl.float32)
    if FAR:
        hi = tl.maximum(n - LOC, 0) * CK
        for c0 in range(0, hi, BN):
            mu, vb, s = _cell_tile(MU, VB, LOGN, RET, q, scale, bh, kvh, n, NB, NCK, c0, hi, offs_n, offs_d, CK, D, UP)
            p, ds = _p_ds(s, qk, lse2, do, vb, delta, UP)
            dq += dot(ds.to(mu.dtype), mu, "tf32x3", UP)
    row = bh * NB + n
    for it in range(0, _list_len(EXL, row, NE, NEP) * (L // BN)):
        mblk = tl.load(EXL + row * NE + it // (L // BN))
        k, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, mblk * L + (it % (L // BN)) * BN, offs_m, offs_n, offs_d,
                              PAD, D, UP)
        p, ds = _p_ds(s, qk, lse2, do, v, delta, UP)
        dq += dot(ds.to(k.dtype), k, "tf32x3", UP)
    for k0 in range(0, (tile * BM) % L + BM, BN):
        k, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, n * L + k0, offs_m, offs_n, offs_d, 2, D, UP)
        p, ds = _p_ds(s, qk, lse2, do, v, delta, UP)
        dq += dot(ds.to(k.dtype), k, "tf32x3", UP)
    tl.store(DQ + (bh * Sp + offs_m)[:, None] * D + offs_d[None, :], dq * scale)


@triton.jit
def _cells_bwd_dkdv(Q, K, V, KVAL, TL, TCNT, DO, LSE, DELTA, DK, DV, scale, H, HKV, NB, Sp, NT,
                    L: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
                    UP: tl.constexpr):
    """dK, dV of the exact keys: one program per (BN keys of block m, batch x kv head, chunk of CH entries) over its
    chunk of the (query head, query block) pairs that attend block m exactly (TL: `exact_readers`, TCNT entries).
    A block read by at most CH pairs (most) is one program that stores its sums; the blocks read by more (a sink
    block is read by every query block of every head) are split over programs that add into DK, DV (zeroed), so no
    program runs much longer than the rest."""
    kt = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    e0 = tl.program_id(2) * CH
    G = H // HKV
    b = bkv // HKV
    hk = bkv % HKV
    offs_n = kt * BN + tl.arange(0, BN)
    m = (kt * BN) // L
    row = bkv * NB + m
    cnt = tl.load(TCNT + row)
    if e0 < cnt:
        offs_d = tl.arange(0, D)
        offs_q = tl.arange(0, BM)
        qk = scale * 1.4426950408889634
        k = tl.load(K + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :])
        v = tl.load(V + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :])
        kv = tl.load(KVAL + b * Sp + offs_n) != 0
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        # one flat loop over (pair, query tile): the loads pipeline across pairs (as the forward's block lists)
        for it in range(e0 * (L // BM), tl.minimum(e0 + CH, cnt) * (L // BM)):
            gn = tl.load(TL + row * NT + it // (L // BM))
            n = gn % NB
            bh = b * H + hk * G + gn // NB
            qpos = n * L + (it % (L // BM)) * BM + offs_q
            q = tl.load(Q + (bh * Sp + qpos)[:, None] * D + offs_d[None, :])
            do = tl.load(DO + (bh * Sp + qpos)[:, None] * D + offs_d[None, :])
            lse2 = tl.load(LSE + bh * Sp + qpos) * 1.4426950408889634
            delta = tl.load(DELTA + bh * Sp + qpos)
            ok = kv[None, :] & ((n != m) | (offs_n[None, :] <= qpos[:, None]))
            s = tl.where(ok, dot(q, tl.trans(k), "tf32x3", UP), float("-inf"))
            p, ds = _p_ds(s, qk, lse2, do, v, delta, UP)
            dv += dot(tl.trans(p.to(do.dtype)), do, "tf32x3", UP)
            dk += dot(tl.trans(ds.to(q.dtype)), q, "tf32x3", UP)
        pk = DK + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :]
        pv = DV + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :]
        if cnt <= CH:
            tl.store(pk, dk * scale)
            tl.store(pv, dv)
        else:
            tl.atomic_add(pk, dk * scale, sem="relaxed")
            tl.atomic_add(pv, dv, sem="relaxed")


@triton.jit
def _cells_bwd_dcells(Q, MU, VB, LOGN, RET, DO, LSE, DELTA, DMU, DVB, scale, H, HKV, NB, Sp, NCK,
                      L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, UP: tl.constexpr):
    """dMU, dVB of BN cells (batch x kv head): over the query blocks after them that do not retrieve their block."""
    ct = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    G = H // HKV
    b = bkv // HKV
    hk = bkv % HKV
    cidx = ct * BN + tl.arange(0, BN)
    okc = cidx < NCK
    cb = cidx // CK
    offs_d = tl.arange(0, D)
    offs_q = tl.arange(0, BM)
    qk = scale * 1.4426950408889634
    mu = tl.load(MU + (bkv * NCK + cidx)[:, None] * D + offs_d[None, :], mask=okc[:, None], other=0.0)
    vb = tl.load(VB + (bkv * NCK + cidx)[:, None] * D + offs_d[None, :], mask=okc[:, None], other=0.0)
    bias = tl.load(LOGN + bkv * NCK + cidx, mask=okc, other=float("-inf")) / scale
    dmu = tl.zeros([BN, D], tl.float32)
    dvb = tl.zeros([BN, D], tl.float32)
    for g in range(G):
        bh = b * H + hk * G + g
        for n in range((ct * BN) // CK + LOC + 1, NB):
            okn = okc & (cb < n - LOC) & (tl.load(RET + (bh * NB + n) * NB + cb, mask=okc, other=1) == 0)
            for q0 in range(0, L, BM):
                qpos = n * L + q0 + offs_q
                q = tl.load(Q + (bh * Sp + qpos)[:, None] * D + offs_d[None, :])
                do = tl.load(DO + (bh * Sp + qpos)[:, None] * D + offs_d[None, :])
                lse2 = tl.load(LSE + bh * Sp + qpos) * 1.4426950408889634
                delta = tl.load(DELTA + bh * Sp + qpos)
                s = tl.where(okn[None, :], dot(q, tl.trans(mu), "tf32x3", UP) + bias[None, :], float("-inf"))
                p, ds = _p_ds(s, qk, lse2, do, vb, delta, UP)
                dvb += dot(tl.trans(p.to(do.dtype)), do, "tf32x3", UP)
                dmu += dot(tl.trans(ds.to(q.dtype)), q, "tf32x3", UP)
    tl.store(DMU + (bkv * NCK + cidx)[:, None] * D + offs_d[None, :], dmu * scale, mask=okc[:, None])
    tl.store(DVB + (bkv * NCK + cidx)[:, None] * D + offs_d[None, :], dvb, mask=okc[:, None])


def cells_tiles(D: int, dtype: torch.dtype, L: int, tiles: MuseTiles = DEFAULT_TILES) -> dict:
    """Launch tiles of the cells kernels: fwd (query tile BM, key tile BN, warps, stages), bwd (BM, BN, warps,
    query tile of the dcells kernel) and dkdv (key tile, query tile, warps, stages of the dK/dV kernel). bf16/fp16:
    the fastest forward and dK/dV of H200 sweeps (benchmarks/ops/bench_muse_cells.py `tune`, `dkdv`: at 64k the dK/dV kernel
    took 17.9 ms with 64 x 64 tiles, 4 warps and 3 stages against 29.1 ms with 64 x 128, 8 warps, 1 stage), and dq /
    dcells tiles that compile without register spills for sm_90 (128 x 64, 8 warps). fp32 (tf32x3 dots): tiles that
    fit sm_90's shared memory with the fewest spills (cuobjdump of the sm_90 build). Tiles divide block_size L (a
    multiple of 128). `tiles.cells_fwd` / `tiles.cells_dkdv` replace the forward's / the dK/dV kernel's (benchmarks'
    sweeps)."""
    if dtype == torch.float32:  # tf32x3 dots keep two tf32 copies of every operand in shared memory
        fwd, bwd = ((128, 64, 8, 1), (64, 32, 4, 32)) if D >= 128 else ((64, 64, 4, 2), (64, 64, 8, 32))
        dkdv = (bwd[1], bwd[3], bwd[2], 1)
    else:
        fwd, bwd = ((128, 128, 8, 3) if D >= 128 else (128, 128, 4, 2)), (128, 64, 8, 128)
        dkdv = (64, 64, 4, 2 if D >= 128 else 3)
    fm, fn, fw, fs = tiles.cells_fwd or fwd
    kn, km, kw, ks = tiles.cells_dkdv or dkdv
    return dict(fwd=(min(fm, L), min(fn, L), fw, fs), bwd=tuple(min(t, L) if i != 2 else t for i, t in enumerate(bwd)),
                dkdv=(min(kn, L), min(km, L), kw, ks))


def _padded(t: torch.Tensor, Sp: int) -> torch.Tensor:
    """t [B, H, S, D] zero-padded to Sp positions, contiguous (no copy when it already is both)."""
    if t.shape[2] != Sp:
        t = torch.nn.functional.pad(t, (0, 0, 0, Sp - t.shape[2]))
    return t.contiguous()


def cells_fwd(q, k, v, mu, vbar, plan: CellsPlan, scale: float, tiles: MuseTiles = DEFAULT_TILES):
    """The forward kernel on q, k, v (exact keys) and the cell means mu, vbar ([B, Hkv, nb, Ck, D]): O [B, Hq, Sp, D]
    (padded to the plan's blocks), and what `cells_bwd` takes (the saved tensors, the sizes and the backward's tiles,
    from `tiles` as the forward's)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    L, Ck, nb, Sp = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len
    tiles = cells_tiles(D, q.dtype, L, tiles)
    Q, K, V = (_padded(t, Sp) for t in (q, k, v))
    far = Ck > 0  # a plan without cells (`cells.list_plan`): the listed blocks and the own block only
    if far:
        MU = mu.reshape(B * Hkv, nb * Ck, D).contiguous()
        VB = vbar.reshape(B * Hkv, nb * Ck, D).contiguous()
        logn = log_counts(plan.counts).reshape(B * Hkv, nb * Ck).contiguous()
    else:  # never read (FAR=False); the kernels take pointers
        MU = VB = K.new_empty(1, 1, D)
        logn = K.new_empty(1, 1, dtype=torch.float32)
    exl = exact_lists(plan)
    # the list kernels' constants; PAD: the listed blocks may hold masked keys (a key mask was given)
    lists = dict(NE=exl.shape[-1], NEP=triton.next_power_of_2(exl.shape[-1]), PAD=int(plan.key_masked))
    ret = plan.retrieved.to(torch.int8).contiguous()
    kval = plan.key_valid.to(torch.int8).contiguous()
    O = torch.empty_like(Q)
    LSE = torch.empty(B, Hq, Sp, device=q.device, dtype=torch.float32)
    up = INTERPRET and q.dtype != torch.float32
    fm, fn, fw, fs = tiles["fwd"]
    _cells_fwd[(B * Hq, Sp // fm)](
        Q, K, V, MU, VB, logn, kval, exl, ret, O, LSE, scale, Hq, Hkv, nb, Sp, nb * Ck,
        L=L, CK=max(Ck, 1), LOC=plan.local_blocks, **lists, D=D, BM=fm, BN=fn, UP=up, FAR=far, num_warps=fw,
        num_stages=fs)
    return O, (Q, K, V, MU, VB, O, LSE, logn, exl, ret, kval), (B, Hq, Hkv, S, D, L, Ck, nb, Sp, plan.local_blocks,
                                                                lists, tiles["bwd"], up, scale, tiles["dkdv"])


def bwd_inputs(do, O):
    """do [B, S, Hq, D] as the kernels take it ([B, Hq, Sp, D] padded, O's dtype) and Delta = rowsum(dO * O)."""
    DO = _padded(do.transpose(1, 2).to(O.dtype), O.shape[2])
    return DO, (DO.float() * O.float()).sum(-1).contiguous()


def cells_bwd_qkv(saved, meta, DO, DELTA):
    """dQ (exact keys and cells), dK and dV (exact keys) in float32, padded to the plan's blocks ([B, H, Sp, D])."""
    Q, K, V, MU, VB, O, LSE, logn, exl, ret, kval = saved
    B, Hq, Hkv, S, D, L, Ck, nb, Sp, loc, lists, (BM, BN, warps, BMK), up, scale, (kn, km, kw, ks) = meta
    f32 = dict(device=Q.device, dtype=torch.float32)
    DQ = torch.empty(B, Hq, Sp, D, **f32)
    DK = torch.zeros(B, Hkv, Sp, D, **f32)  # zeros: the key blocks read by many pairs are summed over programs
    DV = torch.zeros(B, Hkv, Sp, D, **f32)
    readers, counts = exact_readers(ret, loc, Hkv)
    _cells_bwd_dq[(Sp // BM, B * Hq)](
        Q, K, V, MU, VB, logn, kval, exl, ret, DO, LSE, DELTA, DQ, scale, Hq, Hkv, nb, Sp, nb * Ck,
        L=L, CK=max(Ck, 1), LOC=loc, **lists, D=D, BM=BM, BN=BN, UP=up, FAR=Ck > 0, num_warps=warps, num_stages=1)
    nt = readers.shape[-1]
    _cells_bwd_dkdv[(Sp // kn, B * Hkv, triton.cdiv(nt - 1, READERS_CHUNK))](
        Q, K, V, kval, readers, counts, DO, LSE, DELTA, DK, DV, scale, Hq, Hkv, nb, Sp, nt,
        L=L, D=D, BM=km, BN=kn, CH=READERS_CHUNK, UP=up, num_warps=kw, num_stages=ks)
    return DQ, DK, DV


def cells_bwd(saved, meta, do):
    """The backward kernels from `cells_fwd`'s saved tensors and sizes and do [B, S, Hq, D]: the gradients of
    q, k, v, mu and vbar (None for a plan without cells)."""
    Q, K, V, MU, VB, O, LSE, logn, exl, ret, kval = saved
    B, Hq, Hkv, S, D, L, Ck, nb, Sp, loc, lists, (BM, BN, warps, BMK), up, scale, _ = meta
    DO, DELTA = bwd_inputs(do, O)
    DQ, DK, DV = cells_bwd_qkv(saved, meta, DO, DELTA)
    f32 = dict(device=Q.device, dtype=torch.float32)
    cast = lambda t, like: t.to(like.dtype)  # noqa: E731
    dq, dk, dv = cast(DQ[:, :, :S], Q), cast(DK[:, :, :S], K), cast(DV[:, :, :S], V)
    if Ck == 0:
        return dq, dk, dv, None, None
    DMU = torch.empty(B * Hkv, nb * Ck, D, **f32)
    DVB = torch.empty(B * Hkv, nb * Ck, D, **f32)
    _cells_bwd_dcells[(triton.cdiv(nb * Ck, BN), B * Hkv)](
        Q, MU, VB, logn, ret, DO, LSE, DELTA, DMU, DVB, scale, Hq, Hkv, nb, Sp, nb * Ck,
        L=L, CK=Ck, LOC=loc, D=D, BM=BMK, BN=BN, UP=up, num_warps=warps, num_stages=1)
    return dq, dk, dv, cast(DMU.view(B, Hkv, nb, Ck, D), MU), cast(DVB.view(B, Hkv, nb, Ck, D), VB)
