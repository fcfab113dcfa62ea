"""Triton kernels of the MuSe plan: the per-block Lloyd clustering, the cells' block-retrieval scores, the global
query clustering's assignment.

The PyTorch plan (`plan.lloyd`, `cells.make_cells_plan`) issues a few hundred small launches per call (a
farthest-point step is a handful of launches, and there are `C - 1` of them); these kernels do the same work in
one launch each:

- `_lloyd_kernel`: one program per block of `L` bf16 tokens. The block's `[L, D]` tile stays in registers for the
  farthest-point init and the `iters + 1` assign/update rounds (`2 x . c - |c|^2`, ties to the lowest cluster,
  as `plan.lloyd`). Every dot runs on the tensor cores with exact products and fp32 sums (see the kernel).
- `_block_scores_kernel`: one program per (16 query blocks, batch x query head): the retrieval score
  `logsumexp_c(scale * qbar_n . mu_mc + log n_mc)` of every far block m (fp32 dots as three tf32 products),
  written as `[B, Hq, nb, nb]` (-inf where block m is not a far block of n) for `torch.topk`.
- `_block_peaks_kernel`: one program per (query blocks, batch x kv head, 16 key blocks): the peak score
  `max_j scale * qbar_n . k_j` over the real bf16 keys j of every far block m (the block's best key at the mean
  query rounded to bf16; exact products, fp32 sums), in the same layout. The kv head's query heads share each key
  tile.
- `_mark_top` (`mark_top_triton`): the retrieval's top-k per query block, marked in place in one launch (PyTorch's
  top-k, isfinite, gather and scatter: five).
- `_nearest` and `_member_sums` (`nearest_with_sums`): one round of the tilted-cells plan's global query
  clustering (`tilted_cells.cluster_queries`): each token's nearest of up to thousands of centroids, argmax in
  registers over tiles of 64 centroids (bf16 products, fp32 sums: near-ties may go the other way than in
  float32), then the sums and counts of each centroid's members (the one-hot assignment times the tokens on the
  tensor cores: no scatter, no fp32 copy of the queries).

Both compute what the PyTorch versions compute, in fp32, up to the order of the sums: a token at a near-tie
between two clusters may land in the other one. tests/test_muse_plan_triton.py compares them on random,
well-separated and real inputs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..backend import INTERPRET
from ..triton_lib import dot, dot_acc, dot_bf16x3
# the tiles (support.py, no Triton there: the dispatchers' checks use them)
from .support import DEFAULT_TILES, MuseTiles, peaks_tiles, scores_tiles  # noqa: F401

# dots: bf16 operands on the tensor cores with fp32 accumulation (dot_acc; UP: the interpreter's bf16 workaround),
# fp32 centroids against bf16 tokens in three bf16 parts (dot_bf16x3)


@triton.jit
def _lloyd_kernel(X, VALID, CENT, ASSIGN, COUNT, L, C, ITERS, D: tl.constexpr, LP: tl.constexpr,
                  CP: tl.constexpr, UP: tl.constexpr):
    """X [N, L, D] bf16 (contiguous), VALID [N, L] int8 -> CENT [N, C, D] fp32, ASSIGN [N, L] int64, COUNT [N, C]
    fp32. LP, CP: L and C rounded up to powers of two (CP >= 16 for the dots). The tile stays bf16 (its exact
    values) and every dot is exact in its products: a chosen centre in the init is a row of X (bf16), a cluster
    indicator is 0/1, and a mean centroid is split in three bf16 parts (`triton_lib.dot_bf16x3`)."""
    row = tl.program_id(0).to(tl.int64)
    offs_l = tl.arange(0, LP)
    offs_d = tl.arange(0, D)
    offs_c = tl.arange(0, CP)
    in_l = offs_l < L
    base = X + row * L * D
    x = tl.load(base + offs_l[:, None] * D + offs_d[None, :], mask=in_l[:, None], other=0.0)
    val = tl.load(VALID + row * L + offs_l, mask=in_l, other=0) != 0
    xf = x.to(tl.float32)
    x2 = tl.sum(xf * xf, 1)
    # farthest-point init: the first valid token, then the valid token farthest from the chosen ones; the squared
    # distance to a new centre c (column 0 of a [D, 16] operand) is |x|^2 - 2 x.c + |c|^2, clamped at 0
    col0 = tl.arange(0, 16)[None, :] == 0
    idx = tl.argmax(val.to(tl.int32), 0)
    c = tl.load(base + idx * D + offs_d)
    cent = tl.where(offs_c[:, None] == 0, c.to(tl.float32)[None, :], 0.0)
    zero = tl.zeros([LP, 16], dtype=tl.float32)
    cf = c.to(tl.float32)
    xc = tl.sum(dot_acc(x, tl.where(col0, c[:, None], 0.0).to(tl.bfloat16), zero, "tf32", UP), 1)
    dmin = tl.where(offs_l == idx, 0.0, tl.maximum(x2 - 2 * xc + tl.sum(cf * cf, 0), 0.0))
    for j in range(1, C):
        idx = tl.argmax(tl.where(val, dmin, -1.0), 0)
        c = tl.load(base + idx * D + offs_d)
        cf = c.to(tl.float32)
        cent = tl.where(offs_c[:, None] == j, cf[None, :], cent)
        xc = tl.sum(dot_acc(x, tl.where(col0, c[:, None], 0.0).to(tl.bfloat16), zero, "tf32", UP), 1)
        d = tl.maximum(x2 - 2 * xc + tl.sum(cf * cf, 0), 0.0)
        dmin = tl.where(offs_l == idx, 0.0, tl.minimum(dmin, d))
    any_valid = tl.max(val.to(tl.float32), 0)
    cent = cent * any_valid
    vf = val.to(tl.float32)
    in_c = offs_c < C
    a = tl.zeros([LP], dtype=tl.int32)
    cnt = tl.zeros([CP], dtype=tl.float32)
    for _ in range(ITERS + 1):
        s = (2 * dot_bf16x3(x, tl.trans(cent), tl.zeros([LP, CP], dtype=tl.float32), "tf32", UP)
             - tl.sum(cent * cent, 1)[None, :])
        s = tl.where(in_c[None, :], s, float("-inf"))
        a = tl.argmax(s, 1).to(tl.int32)
        oh = tl.where(a[:, None] == offs_c[None, :], vf[:, None], 0.0)
        cnt = tl.sum(oh, 0)
        tot = dot_acc(tl.trans(oh.to(tl.bfloat16)), x, tl.zeros([CP, D], dtype=tl.float32), "tf32", UP)
        cent = tl.where(cnt[:, None] > 0, tot / tl.maximum(cnt, 1.0)[:, None], cent)
    tl.store(CENT + (row * C + offs_c)[:, None] * D + offs_d[None, :], cent, mask=in_c[:, None])
    tl.store(COUNT + row * C + offs_c, cnt, mask=in_c)
    tl.store(ASSIGN + row * L + offs_l, a.to(tl.int64), mask=in_l)


def lloyd_triton(x: torch.Tensor, valid: torch.Tensor, C: int, iters: int):
    """`plan.lloyd` in one launch (same arguments and results)."""
    N, L, D = x.shape
    x = x.contiguous()
    cent = torch.empty(N, C, D, device=x.device, dtype=torch.float32)
    assign = torch.empty(N, L, device=x.device, dtype=torch.int64)
    count = torch.empty(N, C, device=x.device, dtype=torch.float32)
    if N == 0:
        return cent, assign, count
    LP = triton.next_power_of_2(L)
    warps = max(4, min(16, LP * D // 2048))
    _lloyd_kernel[(N,)](x, valid.to(torch.int8).contiguous(), cent, assign, count, L, C, iters, D=D, LP=LP,
                        CP=max(16, triton.next_power_of_2(C)), UP=INTERPRET, num_warps=warps)
    return cent, assign, count


@triton.jit
def _block_scores_kernel(QBAR, CENT, LOGN, BS, scale, HQ, HKV, NB, LOC, D: tl.constexpr, CK: tl.constexpr,
                         NT: tl.constexpr, MT: tl.constexpr):
    """QBAR [B*HQ, NB, D] fp32, CENT [B*HKV, NB*CK, D] fp32, LOGN [B*HKV, NB*CK] fp32 -> BS [B*HQ, NB, NB]
    (pre-filled with -inf; the programs write the far blocks m < n - LOC)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bkv = (bh // HQ) * HKV + (bh % HQ) // (HQ // HKV)
    offs_n = pid * NT + tl.arange(0, NT)
    offs_d = tl.arange(0, D)
    offs_j = tl.arange(0, MT * CK)
    offs_m = tl.arange(0, MT)
    in_n = offs_n < NB
    qbar = tl.load(QBAR + (bh * NB + offs_n)[:, None] * D + offs_d[None, :], mask=in_n[:, None], other=0.0)
    hi = tl.minimum(NB, pid * NT + NT - 1 - LOC)  # far blocks of the tile's last query block
    for m0 in range(0, hi, MT):
        col = m0 * CK + offs_j
        in_j = col < NB * CK
        mu = tl.load(CENT + (bkv * NB * CK + col)[:, None] * D + offs_d[None, :], mask=in_j[:, None], other=0.0)
        logn = tl.load(LOGN + bkv * NB * CK + col, mask=in_j, other=float("-inf"))
        s = tl.dot(qbar, tl.trans(mu), input_precision="tf32x3") * scale + logn[None, :]
        s = tl.reshape(s, (NT, MT, CK))
        mx = tl.max(s, 2)
        mxs = tl.where(mx == float("-inf"), 0.0, mx)
        lse = mxs + tl.log(tl.sum(tl.exp(s - mxs[:, :, None]), 2))
        m = m0 + offs_m
        far = m[None, :] < offs_n[:, None] - LOC
        tl.store(BS + (bh * NB + offs_n)[:, None] * NB + m[None, :], tl.where(far, lse, float("-inf")),
                 mask=in_n[:, None] & (m < NB)[None, :])


def block_scores_triton(qbar: torch.Tensor, cent: torch.Tensor, logn: torch.Tensor, *, scale: float,
                        local_blocks: int) -> torch.Tensor:
    """qbar [B, Hq, nb, D], cent [B, Hkv, nb, Ck, D], logn [B, Hkv, nb, Ck] (fp32) -> [B, Hq, nb, nb] fp32: the
    score of block m for query block n when m < n - local_blocks, else -inf."""
    B, Hq, nb, D = qbar.shape
    Hkv, Ck = cent.shape[1], cent.shape[3]
    bs = torch.full((B, Hq, nb, nb), -math.inf, device=qbar.device, dtype=torch.float32)
    NT, MT = scores_tiles(D, Ck)
    _block_scores_kernel[(triton.cdiv(nb, NT), B * Hq)](
        qbar.float().contiguous(), cent.float().contiguous(), logn.float().contiguous(), bs, scale, Hq, Hkv, nb,
        local_blocks, D=D, CK=Ck, NT=NT, MT=MT, num_warps=4)
    return bs


@triton.jit
def _block_peaks_kernel(QBAR, K, KVAL, BS, scale, HQ, HKV, NB, SP, LOC, L: tl.constexpr, D: tl.constexpr,
                        NT: tl.constexpr, GP: tl.constexpr, BL: tl.constexpr, MC: tl.constexpr, UP: tl.constexpr):
    """QBAR [B*HQ, NB, D] bf16 (the mean queries rounded to the keys' dtype), K [B*HKV, SP, D] bf16 (SP = NB * L),
    KVAL [B, SP] int8 -> BS [B*HQ, NB, NB] (pre-filled with -inf; the programs write the far blocks m < n - LOC:
    -inf where block m has no real key). One program per (NT query blocks, batch x kv head, MC key blocks): its
    rows are the NT query blocks of each of the kv head's G = HQ / HKV query heads (GP: G rounded up to a power of
    two), so every key tile is loaded once for the G heads and enters one [GP * NT, D] x [D, BL] product."""
    pid = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    G = HQ // HKV
    b = bkv // HKV
    r = tl.arange(0, GP * NT)
    g = r // NT
    offs_n = pid * NT + r % NT
    bh = b * HQ + (bkv % HKV) * G + g  # each row's query head
    offs_d = tl.arange(0, D)
    offs_l = tl.arange(0, BL)
    ok_r = (g < G) & (offs_n < NB)
    qbar = tl.load(QBAR + (bh * NB + offs_n)[:, None] * D + offs_d[None, :], mask=ok_r[:, None], other=0.0)
    hi = tl.minimum(NB, pid * NT + NT - 1 - LOC)  # far blocks of the tile's last query block
    m0 = tl.program_id(2) * MC  # this program's MC key blocks (programs past `hi` have none)
    for m in range(m0, tl.minimum(hi, m0 + MC)):
        best = tl.full([GP * NT], float("-inf"), tl.float32)
        for l0 in tl.static_range(0, L, BL):
            pos = m * L + l0 + offs_l
            kt = tl.load(K + (bkv * SP + pos)[:, None] * D + offs_d[None, :])
            ok = tl.load(KVAL + b * SP + pos) != 0
            s = dot_acc(qbar, tl.trans(kt), tl.zeros([GP * NT, BL], dtype=tl.float32), "tf32", UP)
            best = tl.maximum(best, tl.max(tl.where(ok[None, :], s, float("-inf")), 1))
        far = m < offs_n - LOC
        tl.store(BS + (bh * NB + offs_n) * NB + m, tl.where(far, best * scale, float("-inf")), mask=ok_r)


def block_peaks_triton(qbar: torch.Tensor, kb: torch.Tensor, key_valid: torch.Tensor, *, scale: float,
                       local_blocks: int, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """qbar [B, Hq, nb, D] fp32, kb [B, Hkv, nb, L, D] (the keys by block, padded), key_valid [B, nb * L] bool ->
    [B, Hq, nb, nb] fp32: the peak score of block m for query block n when m < n - local_blocks, else -inf.
    tiles: (keys per tile, warps, stages) instead of `peaks_tiles`' defaults (the benchmark's sweep)."""
    B, Hq, nb, D = qbar.shape
    Hkv, L = kb.shape[1], kb.shape[3]
    bs = torch.full((B, Hq, nb, nb), -math.inf, device=qbar.device, dtype=torch.float32)
    NT, GP, BL, warps, stages = peaks_tiles(D, L, Hq // Hkv, tiles)
    MC = 16  # key blocks per program
    _block_peaks_kernel[(triton.cdiv(nb, NT), B * Hkv, triton.cdiv(nb, MC))](
        qbar.to(kb.dtype).contiguous(), kb.reshape(B * Hkv, nb * L, D).contiguous(),
        key_valid.to(torch.int8).contiguous(), bs, scale, Hq, Hkv, nb, nb * L, local_blocks, L=L, D=D, NT=NT, GP=GP,
        BL=BL, MC=MC, UP=INTERPRET, num_warps=warps, num_stages=stages)
    return bs


@triton.jit
def _mark_top(R, SC, N, K, NP: tl.constexpr):
    """Row r of SC [rows, N] fp32: its K highest entries above -inf among those R [rows, N] (int8) does not yet mark
    are marked (set to 1), by K rounds of argmax in registers (the lowest index on ties)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NP)
    inb = offs < N
    got = tl.load(R + row * N + offs, mask=inb, other=0)
    s = tl.load(SC + row * N + offs, mask=inb, other=float("-inf"))
    s = tl.where(got != 0, float("-inf"), s)
    for _ in range(K):
        pick = (offs == tl.argmax(s, 0, tie_break_left=True)) & (s > float("-inf"))  # none once all are -inf
        got = tl.where(pick, 1, got).to(tl.int8)
        s = tl.where(pick, float("-inf"), s)
    tl.store(R + row * N + offs, got, mask=inb)


def mark_top_supported(n: int) -> bool:
    """Rows of n blocks fit `_mark_top`'s registers."""
    return n <= 8192


def mark_top_triton(retrieved: torch.Tensor, scores: torch.Tensor, k: int) -> None:
    """`cells.take_top` in one launch: retrieved [..., N] bool (contiguous, CUDA; marked in place), scores of the same
    shape, fp32."""
    if not retrieved.is_contiguous() or retrieved.shape != scores.shape:
        raise ValueError("mark_top_triton: `retrieved` must be contiguous and shaped as `scores`")
    N = scores.shape[-1]
    rows = scores.numel() // max(1, N)
    if rows == 0 or k <= 0:
        return
    NP = triton.next_power_of_2(N)
    _mark_top[(rows,)](retrieved.view(torch.int8), scores.float().contiguous(), N, k, NP=NP,
                       num_warps=1 if NP <= 256 else 4 if NP <= 2048 else 8)


@triton.jit
def _nearest(X, C, C2, A, S, CQ, D: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, UP: tl.constexpr):
    """Program (tile of BM tokens, batch x head): each token's nearest centroid, argmax of 2 x.c - |c|^2 (the products
    on the tensor cores in the tokens' dtype, fp32 sums; lowest index on ties), over tiles of BC centroids."""
    bh = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = r < S
    offs_d = tl.arange(0, D)
    x = tl.load(X + (bh * S + r)[:, None] * D + offs_d[None, :], mask=rm[:, None], other=0.0)
    best = tl.full([BM], float("-inf"), tl.float32)
    arg = tl.zeros([BM], tl.int32)
    for c0 in range(0, CQ, BC):
        cc = c0 + tl.arange(0, BC)
        cm = cc < CQ
        c = tl.load(C + (bh * CQ + cc)[:, None] * D + offs_d[None, :], mask=cm[:, None], other=0.0)
        c2 = tl.load(C2 + bh * CQ + cc, mask=cm, other=0.0)
        sc = tl.where(cm[None, :], 2 * dot(x, tl.trans(c), "tf32x3", UP) - c2[None, :], float("-inf"))
        m = tl.max(sc, 1)
        am = tl.argmax(sc, 1, tie_break_left=True)
        upd = m > best
        best = tl.where(upd, m, best)
        arg = tl.where(upd, c0 + am, arg)
    tl.store(A + bh * S + r, arg, mask=rm)


@triton.jit
def _member_sums(X, A, VALID, SUM, CNT, H, S, CQ, TPP, D: tl.constexpr, BM: tl.constexpr, CA: tl.constexpr,
                 UP: tl.constexpr):
    """Program (chunk of CA centroids, chunk t of TPP tokens, batch x head): the sums and counts of the chunk's real
    tokens (VALID [B, S] int8) assigned (A) to each of the program's CA centroids, the transposed one-hot [CA, BM]
    times the tokens and times ones on the tensor cores (exact products, fp32 sums), into SUM[bh, t, c, :] and
    CNT[bh, t, c], summed over t by the caller."""
    tc = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    nt = tl.num_programs(1)
    b = bh // H
    offs_d = tl.arange(0, D)
    ca = tl.program_id(0) * CA + tl.arange(0, CA)  # centroid chunks vary fastest: they share x through the L2
    acc = tl.zeros([CA, D], tl.float32)
    cnt16 = tl.zeros([CA, 16], tl.float32)  # the counts, by a product with ones (a row sum would take shuffles)
    ones = tl.full([BM, 16], 1.0, X.dtype.element_ty)
    for t0 in range(tc * TPP, tc * TPP + TPP, BM):
        r = t0 + tl.arange(0, BM)
        rm = r < S
        x = tl.load(X + (bh * S + r)[:, None] * D + offs_d[None, :], mask=rm[:, None], other=0.0)
        a = tl.load(A + bh * S + r, mask=rm, other=-1)
        a = tl.where(tl.load(VALID + b * S + r, mask=rm, other=0) != 0, a, -1)  # padding: no centroid
        oh = tl.where(ca[:, None] == a[None, :], 1.0, 0.0).to(x.dtype)
        acc = dot_acc(oh, x, acc, "tf32", UP)
        cnt16 = dot_acc(oh, ones, cnt16, "tf32", UP)
    cnt = tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, cnt16, 0.0), 1)
    cm = ca < CQ
    tl.store(SUM + ((bh * nt + tc) * CQ + ca)[:, None] * D + offs_d[None, :], acc, mask=cm[:, None])
    tl.store(CNT + (bh * nt + tc) * CQ + ca, cnt, mask=cm)


def member_tiles(D: int, C: int, tiles: MuseTiles = DEFAULT_TILES) -> tuple[int, int, int, int, int]:
    """`_member_sums`' centroids per program CA, tokens per step BM, warps, stages and the most token chunks per head
    (each a program writing partial sums): the fastest of an H200 sweep at 64k (benchmarks/ops/bench_muse_tilted.py
    `cluster_tune`: 0.33 ms a round with 256 centroids at D 64, 0.93 with the first one-hot kernel);
    `tiles.cluster_member` replaces them."""
    CA, BM, warps, stages, chunks = tiles.cluster_member or (64, 64, 4, 3, 16)
    return min(CA, triton.next_power_of_2(max(C, 16))), BM, warps, stages, chunks


def nearest_with_sums(x: torch.Tensor, cent: torch.Tensor, valid: torch.Tensor, tiles: MuseTiles = DEFAULT_TILES):
    """One Lloyd round: x [B, H, S, D] (bf16/fp16, CUDA), cent [B, H, C, D] float32, valid [B, S] bool -> each token's
    nearest centroid [B, H, S] int64 (`_nearest`: the centroids rounded to x's dtype in the products, |c|^2 in
    float32), and per centroid the sum [B, H, C, D] and count [B, H, C] (float32) of the real tokens assigned to it
    (`_member_sums`): the round's new means without a scatter or an fp32 copy of x. `tiles.cluster_nearest` /
    `cluster_member`: the two kernels' tiles instead of the defaults."""
    B, H, S, D = x.shape
    C = cent.shape[2]
    x = x.contiguous()
    a = torch.empty(B, H, S, device=x.device, dtype=torch.int32)
    nm, nc, nw = tiles.cluster_nearest or (128, 64, 8 if D >= 128 else 4)
    _nearest[(triton.cdiv(S, nm), B * H)](
        x, cent.to(x.dtype).contiguous(), (cent * cent).sum(-1).contiguous(), a, S, C, D=D, BM=nm, BC=nc,
        UP=INTERPRET, num_warps=nw)
    CA, BM, warps, stages, chunks = member_tiles(D, C, tiles)
    # token chunks per head: up to `chunks`, fewer where the partial sums would pass 256 MiB
    nt = max(1, min(chunks, triton.cdiv(S, BM), (1 << 28) // (B * H * C * D * 4)))
    tpp = BM * triton.cdiv(triton.cdiv(S, nt), BM)
    nt = triton.cdiv(S, tpp)
    sums = torch.empty(B * H, nt, C, D, device=x.device, dtype=torch.float32)
    cnt = torch.empty(B * H, nt, C, device=x.device, dtype=torch.float32)
    _member_sums[(triton.cdiv(C, CA), nt, B * H)](
        x, a, valid.to(torch.int8).contiguous(), sums, cnt, H, S, C, tpp, D=D, BM=BM, CA=CA, UP=INTERPRET,
        num_warps=warps, num_stages=stages)
    return a.long(), sums.sum(1).view(B, H, C, D), cnt.sum(1).view(B, H, C)
