"""The Triton forward of MuSe's tilted-cells far field (`reference_tilted_cells.py` has the plan, the reference and the design):
the tilted summaries of every (query cluster, cell) pair, then the far field over the queries sorted by cluster,
merged with the exact part (the cells kernels without a far field). Imported only when the Triton backend runs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import dot, online_softmax_scaled
from .reference_cells import CellsPlan
from .reference_tilted_cells import TiltPlan
from .support import DEFAULT_TILES, MuseTiles, check_tiles
from .triton_cells import cells_fwd


@triton.jit
def _tilt_summaries(K, V, KORD, CST, C, LSE, KT, VT, scale, H, HKV, H0, HC, Sp, NB, NCK, CQ,
                    L: tl.constexpr, CK: tl.constexpr, D: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                    UP: tl.constexpr):
    """Program (block m, batch x query head, tile of BC centroids): the block's Ck cells tilted at each centroid. The
    block's keys sorted by cell (KORD, cell j at offsets CST[j] .. CST[j + 1]) make each cell a contiguous segment:
    per segment, one online softmax over chunks of BK keys of x = scale c.k (log2 units) whose weights 2^x average
    the keys and the values (three [BC, BK] x [BK, D]-sized products per chunk: 6 D FLOP per centroid and key).
    Heads H0 .. H0 + HC - 1 (a chunk of the query heads): program id 1 runs over batch x those heads, and the
    summaries are written for them only (LSE, KT, VT hold B * HC heads)."""
    m = tl.program_id(0)
    lh = tl.program_id(1).to(tl.int64)  # the chunk's (batch, head)
    b = lh // HC
    h = H0 + lh % HC
    bh = b * H + h
    kvh = b * HKV + h // (H // HKV)
    offs_k = tl.arange(0, BK)
    offs_d = tl.arange(0, D)
    offs_c = tl.program_id(2) * BC + tl.arange(0, BC)
    cm = offs_c < CQ
    c = tl.load(C + (bh * CQ + offs_c)[:, None] * D + offs_d[None, :], mask=cm[:, None], other=0.0)
    qk = scale * 1.4426950408889634
    row = (lh * CQ + offs_c) * NCK + m * CK
    for j in range(CK):
        s0 = tl.load(CST + (kvh * NB + m) * (CK + 1) + j)
        s1 = tl.load(CST + (kvh * NB + m) * (CK + 1) + j + 1)
        m_i = tl.full([BC], float("-inf"), tl.float32)
        l_i = tl.zeros([BC], tl.float32)
        kt = tl.zeros([BC, D], tl.float32)
        vt = tl.zeros([BC, D], tl.float32)
        for k0 in range(s0, s1, BK):
            inb = k0 + offs_k < s1
            pos = m * L + tl.load(KORD + kvh * Sp + m * L + k0 + offs_k, mask=inb, other=0)
            k = tl.load(K + (kvh * Sp + pos)[:, None] * D + offs_d[None, :], mask=inb[:, None], other=0.0)
            v = tl.load(V + (kvh * Sp + pos)[:, None] * D + offs_d[None, :], mask=inb[:, None], other=0.0)
            x = tl.where(inb[None, :], dot(c, tl.trans(k), "tf32x3", UP), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 1) * qk)
            p = tl.exp2(x * qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            kt = kt * alpha[:, None] + dot(p.to(k.dtype), k, "tf32x3", UP)
            vt = vt * alpha[:, None] + dot(p.to(v.dtype), v, "tf32x3", UP)
            m_i = m_new
        has = l_i > 0
        ls = tl.where(has, l_i, 1.0)
        tl.store(LSE + row + j, tl.where(has, (m_i + tl.log2(ls)) * 0.6931471805599453, float("-inf")), mask=cm)
        tl.store(KT + (row + j)[:, None] * D + offs_d[None, :], (kt / ls[:, None]).to(KT.dtype.element_ty),
                 mask=cm[:, None])
        tl.store(VT + (row + j)[:, None] * D + offs_d[None, :], (vt / ls[:, None]).to(VT.dtype.element_ty),
                 mask=cm[:, None])


@triton.jit
def far_load(KT, VT, LSE, base, cidx, inb, offs_d, D: tl.constexpr):
    """Summaries base + cidx of one (cluster, head): kt, vt [BN, D] and lse [BN] (-inf outside `inb`)."""
    kt = tl.load(KT + (base + cidx)[:, None] * D + offs_d[None, :], mask=inb[:, None], other=0.0)
    vt = tl.load(VT + (base + cidx)[:, None] * D + offs_d[None, :], mask=inb[:, None], other=0.0)
    lse = tl.load(LSE + base + cidx, mask=inb, other=float("-inf"))
    return kt, vt, lse


@triton.jit
def far_logits(d, kt, lse, RET, rows, n, bh, j0, cidx, NB, NW, scale, CK: tl.constexpr, BN: tl.constexpr,
               UP: tl.constexpr):
    """Unscaled logits [BM, BN] of the rows (q - c = d, query blocks n) against far cells j0 .. j0 + BN of their
    cluster: d.kt + lse / scale (the callers multiply by scale); -inf where masked. RET (`far_bits`) holds, per row
    block n, the blocks whose cells it sees (far: m < n - local, and not retrieved), a tile's cells spanning at most
    32 blocks (one or two int32 words); rows outside `rows` load no bits. Empty cells and cells past the end of the
    loaded tile have lse = -inf, so their logits are -inf through the bias, without a mask."""
    mblk = cidx // CK
    w0 = (j0 // CK) // 32
    w1 = tl.minimum(((j0 + BN - 1) // CK) // 32, NW - 1)  # a word past the last holds no far block
    b0 = tl.load(RET + (bh * NB + n) * NW + w0, mask=rows, other=0)
    b1 = tl.load(RET + (bh * NB + n) * NW + w1, mask=rows, other=0)
    word = tl.where((mblk // 32 == w0)[None, :], b0[:, None], b1[:, None])
    ok = ((word >> (mblk % 32)[None, :]) & 1) != 0
    return tl.where(ok, dot(d, tl.trans(kt), "tf32x3", UP) + (lse / scale)[None, :], float("-inf"))


@triton.jit
def sorted_rows(Q, ORD, SCL, H, H0, HC, Sp, L: tl.constexpr, D: tl.constexpr, BM: tl.constexpr):
    """The program's tile of BM queries in sorted order (program id 0) for batch x head program id 1 (of the head
    chunk H0 .. H0 + HC - 1): chunk-local head lh, global bh, the rows' positions, clusters (the number of clusters
    for a padding position), query blocks and queries."""
    lh = tl.program_id(1).to(tl.int64)
    bh = (lh // HC) * H + H0 + lh % HC
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    pos = tl.load(ORD + bh * Sp + r).to(tl.int64)
    cl = tl.load(SCL + bh * Sp + r)
    q = tl.load(Q + (bh * Sp + pos)[:, None] * D + tl.arange(0, D)[None, :])
    return lh, bh, pos, cl, (pos // L).to(tl.int32), q


@triton.jit
def cluster_rows_tilt(C, KT, q, cl, n, c, lh, bh, NCK, CQ, CK: tl.constexpr, LOC: tl.constexpr, D: tl.constexpr):
    """For cluster c of a tile: its rows, d = q - c (formed in fp32, rounded once to the summaries' dtype), the end of
    the far cells its rows see (cells of blocks < max n - LOC) and the offset of its summaries."""
    rows = cl == c
    cen = tl.load(C + (bh * CQ + c) * D + tl.arange(0, D)).to(tl.float32)
    d = (q.to(tl.float32) - cen[None, :]).to(KT.dtype.element_ty)
    hi = tl.maximum(tl.max(tl.where(rows, n, 0), 0) - LOC, 0) * CK
    return rows, d, hi, (lh * CQ + c) * NCK


@triton.jit
def _tilt_far_fwd(Q, ORD, SCL, C, LSE, KT, VT, RET, O, LSEE, scale, H, H0, HC, NB, NW, Sp, NCK, CQ,
                  L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, UP: tl.constexpr):
    """Program (tile of BM queries in sorted order, batch x query head): for each query cluster c in the tile, the
    far cells of its rows (cells of blocks < n - LOC, not retrieved for the row's block n) as super-keys of logit
    lse + scale (q - c).kt and value vt, one online softmax; then merged with the exact part (O, LSEE at the rows'
    positions: the cells kernels' output) and both written back in place (LSEE: the merged log-sum-exp, for the
    backward). Heads H0 .. H0 + HC - 1 (the summaries' chunk), as in `_tilt_summaries`."""
    lh, bh, pos, cl, n, q = sorted_rows(Q, ORD, SCL, H, H0, HC, Sp, L, D, BM)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    qk = scale * 1.4426950408889634
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    c_lo = tl.min(cl, 0)
    c_hi = tl.max(tl.where(cl < CQ, cl, -1), 0)
    for c in range(c_lo, c_hi + 1):
        rows, d, hi, base = cluster_rows_tilt(C, KT, q, cl, n, c, lh, bh, NCK, CQ, CK, LOC, D)
        for j0 in range(0, hi, BN):
            cidx = j0 + offs_n
            kt, vt, lse = far_load(KT, VT, LSE, base, cidx, cidx < hi, offs_d, D)
            s = far_logits(d, kt, lse, RET, rows, n, bh, j0, cidx, NB, NW, scale, CK, BN, UP)
            m_i, l_i, acc = online_softmax_scaled(s, qk, vt, m_i, l_i, acc, "tf32x3", UP, True)
    # merge with the exact part: weights 2^(lse_e - M) and 2^(m_i - M) l_i at the common max M (log2 units)
    real = cl < CQ
    oe = tl.load(O + (bh * Sp + pos)[:, None] * D + offs_d[None, :]).to(tl.float32)
    le = tl.load(LSEE + bh * Sp + pos) * 1.4426950408889634
    mx = tl.maximum(le, m_i)
    we = tl.exp2(le - mx)
    wf = tl.where(l_i > 0, tl.exp2(m_i - mx), 0.0)
    z = we + wf * l_i
    o = (we[:, None] * oe + wf[:, None] * acc) / z[:, None]
    tl.store(O + (bh * Sp + pos)[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty), mask=real[:, None])
    tl.store(LSEE + bh * Sp + pos, (mx + tl.log2(z)) * 0.6931471805599453, mask=real)


def tilted_tiles(D: int, dtype: torch.dtype, tiles: MuseTiles = DEFAULT_TILES) -> dict:
    """Launch tiles: summaries (centroids BC, keys BK per chunk, warps), far field (BM, BN, warps, stages);
    `tiles.tilted_summ` / `tiles.tilted_far` replace them (benchmarks' sweeps)."""
    # bf16 / fp16: the fastest of H200 sweeps at 64k (benchmarks/ops/bench_muse_tilted.py `far_tune`: the forward
    # without its plan took 15.4 / 26.2 ms at D 64 / 128 with these against 19.2 / 37.3 with the earlier 128 x 64
    # (D 64) or 64 x 64 (D 128) far tiles at 8 warps and 8-warp summaries at D 128); fp32 (tf32x3 dots) keeps tiles
    # that fit sm_90's shared memory
    f32 = dtype == torch.float32
    far = tiles.tilted_far or ((64, 64, 8, 2) if f32 else (64, 64, 4, 3))
    return dict(summ=tiles.tilted_summ or (64, 32, 8 if f32 else 4), far=far)


def far_bits(retrieved: torch.Tensor, local_blocks: int) -> torch.Tensor:
    """The blocks each query block sees through the far field, as bits: [B, Hq, nb, nb] bool (retrieved) ->
    [B, Hq, nb, ceil(nb / 32)] int32, bit m % 32 of word m // 32 set when m < n - local_blocks and block m is not
    retrieved for query block n (two's complement: bit 31 is the sign bit)."""
    nb = retrieved.shape[-1]
    nw = triton.cdiv(nb, 32)
    ar = torch.arange(nb, device=retrieved.device)
    seen = (ar[None, :] < ar[:, None] - local_blocks) & ~retrieved
    r = torch.nn.functional.pad(seen, (0, nw * 32 - nb)).view(*retrieved.shape[:-1], nw, 32).to(torch.int64)
    w = (r << torch.arange(32, device=r.device)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()


def cell_order(cp: CellsPlan):
    """Each block's keys sorted by cell: offsets within the block [B, Hkv, Sp] int32 (cell 0's real keys first, then
    cell 1's, ..., masked keys last) and each cell's range [B, Hkv, nb, Ck + 1] int32 (cell j: CST[j] .. CST[j + 1])."""
    B, Hkv, Sp = cp.k_assign.shape
    L, Ck, nb = cp.block_size, cp.k_clusters, cp.num_blocks
    cell = torch.where(cp.key_valid[:, None, :], cp.k_assign, Ck).view(B, Hkv, nb, L)
    key = (cell * L + torch.arange(L, device=cell.device)).to(torch.int32)  # < (Ck + 1) L: 32-bit keys sort faster
    order = key.argsort(-1).to(torch.int32).view(B, Hkv, Sp).contiguous()
    cst = torch.zeros(B, Hkv, nb, Ck + 1, device=cell.device, dtype=torch.int32)
    cst[..., 1:] = cp.counts.to(torch.int32).cumsum(-1)
    return order, cst


SUMMARY_BYTES = 4 << 30  # the most memory the tilted summaries of one chunk of query heads take


def tilted_cells_fwd(q, k, v, plan: TiltPlan, scale: float, summary_bytes: int = SUMMARY_BYTES,
                     tiles: MuseTiles | None = None):
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] (one dtype, D a power of two in 16..128, block_size a multiple of 128)
    -> o [B, S, Hq, D]: the exact part on the cells kernels (no far field), then per chunk of query heads whose
    summaries fit in `summary_bytes` (at least one head), the tilted summaries and the far field merged into it.
    `tiles`: launch tiles replacing the defaults (`support.MuseTiles`; None: the defaults)."""
    return tilted_cells_forward(q, k, v, plan, scale, summary_bytes, tiles)[0]


def tilted_cells_forward(q, k, v, plan: TiltPlan, scale: float, summary_bytes: int = SUMMARY_BYTES,
                         tiles: MuseTiles | None = None):
    """`tilted_cells_fwd`, with what the backward takes: (o, saved tensors, sizes). The saved tensors are the cells
    kernels' (their O and LSE the merged output and log-sum-exp) and the far field's plan tensors; the sizes carry
    `tiles` for the backward."""
    tiles = check_tiles(tiles)
    cp = plan.cells
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    L, Ck, nb, Sp, loc = cp.block_size, cp.k_clusters, cp.num_blocks, cp.padded_len, cp.local_blocks
    Cq = plan.centroids.shape[2]
    empty = cp.counts.new_zeros(B, 0)
    exact = CellsPlan(L, 0, loc, Sp, nb, empty, empty, cp.key_valid, cp.retrieved, cp.max_retrieved, cp.key_masked)
    O, saved, meta = cells_fwd(q, k, v, None, None, exact, scale, tiles)
    Q, K, V, LSEE = saved[0], saved[1], saved[2], saved[6]
    korder, cstart = cell_order(cp)
    C = plan.centroids.contiguous()
    order = plan.order.contiguous()
    NCK = nb * Ck
    valid = cp.key_valid[:, None, :]
    scl = torch.where(valid, plan.assign, Cq).gather(2, plan.order.long()).to(torch.int32).contiguous()
    ret = far_bits(cp.retrieved, loc)
    up = INTERPRET and q.dtype != torch.float32
    t = tilted_tiles(D, q.dtype, tiles)
    bm, bn, fw, fs = t["far"]
    bn = min(bn, 32 * Ck)  # a tile's cells span at most 32 blocks: two words of the bits
    hc = head_chunk(B, Hq, Cq, NCK, D, q.element_size(), summary_bytes)
    LSE = torch.empty(B * hc, Cq, NCK, device=q.device, dtype=torch.float32)
    KT = torch.empty(B * hc, Cq, NCK, D, device=q.device, dtype=q.dtype)
    VT = torch.empty_like(KT)
    for h0 in range(0, Hq, hc):
        n = min(hc, Hq - h0)
        summaries(K, V, korder, cstart, C, LSE, KT, VT, scale, h0, n, (B, Hq, Hkv, Sp, nb, Ck, Cq, L, D), up,
                  t["summ"])
        _tilt_far_fwd[(Sp // bm, B * n)](
            Q, order, scl, C, LSE, KT, VT, ret, O, LSEE, scale, Hq, h0, n, nb, ret.shape[-1], Sp, NCK, Cq,
            L=L, CK=Ck, LOC=loc, D=D, BM=bm, BN=bn, UP=up, num_warps=fw, num_stages=fs)
    tilt = (korder, cstart, C, order, scl, ret)
    return O[:, :, :S].transpose(1, 2), saved + tilt, (meta, len(saved), Ck, Cq, summary_bytes, tiles)


def head_chunk(B, Hq, Cq, NCK, D, itemsize, summary_bytes, arrays: int = 1) -> int:
    """Query heads per chunk: as many as have their tilted summaries (`arrays` copies of lse, kt, vt) fit in
    summary_bytes (at least one), then evened out over the chunks that takes (32 heads that fit 31 at a time run as
    16 + 16, not as 31 + 1, whose second launch would leave most of the GPU idle)."""
    per_head = arrays * B * Cq * NCK * (2 * D * itemsize + 4)
    most = max(1, min(Hq, summary_bytes // per_head))
    chunks = -(-Hq // most)
    return -(-Hq // chunks)


def summaries(K, V, korder, cstart, C, LSE, KT, VT, scale, h0, n, sizes, up, tiles):
    """Launch `_tilt_summaries` for query heads h0 .. h0 + n - 1 into LSE, KT, VT (chunk-local heads)."""
    B, Hq, Hkv, Sp, nb, Ck, Cq, L, D = sizes
    bc, bk, sw = tiles
    _tilt_summaries[(nb, B * n, triton.cdiv(Cq, bc))](
        K, V, korder, cstart, C, LSE, KT, VT, scale, Hq, Hkv, h0, n, Sp, nb, nb * Ck, Cq, L=L, CK=Ck, D=D, BC=bc,
        BK=bk, UP=up, num_warps=sw)
