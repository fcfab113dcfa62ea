"""MuSe with a linear-cost far field ("cells"): every earlier block is summarised by its key cells, shared by all
queries, instead of one tilted summary per (query cluster, cell) pair.

Query block n (blocks of L tokens) attends exactly to its own block (causally), to the `local_blocks` blocks
before it and to the `topk_blocks` earlier blocks that score highest at the block's mean query; every other
earlier block m enters through its `k_clusters` key cells (Lloyd clusters of its keys, as in the tilted design),
each cell one super-key with

    logit = scale * q . mu_c + log n_c        value = mean value of the cell

the monopole of the cell's keys expanded at their mean (the untilted limit, c = 0, of docs/muse.md section 1).
The super-keys do not depend on the query, so the far field is one attention over `S / L * k_clusters`
compressed keys: the work per query is `(2 + topk_blocks) * L + (n - 1 - local) * k_clusters` keys instead of
`n * L`, linear in the number of blocks.

Two paths compute the same function:
- `cells_reference`: dense PyTorch per chunk of query blocks (any device, differentiable);
- `cells_triton`: Triton kernels in an `autograd.Function`. Forward: one program per (128-query tile, batch x
  query head) runs one online softmax over the cell keys of the far blocks (a contiguous `[nb * Ck, D]` array,
  with `log n` as a bias and the retrieved blocks masked), the retrieved and local blocks (a per-query-block
  list) and its own block (causal). Backward (FlashAttention-2 scheme, recomputing P from the saved LSE, no
  atomics): dQ per query tile; dK/dV per exact key tile over the query blocks that attend it exactly; dMU/dVB
  per cell tile over the query blocks that summarise it; the cell means' gradients reach k and v through
  `cell_summaries` (autograd).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .cluster import block_peaks_supported, block_peaks_triton, block_scores_supported, block_scores_triton
from .plan import _blocks, lloyd, log_counts
from .reference import masked_softmax


@dataclass
class CellsPlan:
    block_size: int
    k_clusters: int
    local_blocks: int
    padded_len: int
    num_blocks: int
    k_assign: torch.Tensor  # [B, Hkv, Sp] int64: cell of each key within its block
    counts: torch.Tensor  # [B, Hkv, nb, Ck] float32: real keys per cell
    key_valid: torch.Tensor  # [B, Sp] bool
    retrieved: torch.Tensor  # [B, Hq, nb, nb] bool: block m exact for query block n (sinks, retrieved; not local)
    max_retrieved: int  # an upper bound on retrieved.sum(-1), known without reading the tensor
    key_masked: bool = False  # a key mask was given: blocks before the last may hold masked keys


@torch.no_grad()
def make_cells_plan(q, k, *, scale: float, block_size: int = 256, k_clusters: int = 32, kmeans_iters: int = 2,
                    topk_blocks: int = 8, peak_blocks: int = 0, local_blocks: int = 1, sink_blocks: int = 1,
                    key_mask: torch.Tensor | None = None, chunk_elems: int = 2**26, backend: str = "auto") -> CellsPlan:
    """Key cells per block and kv head (Lloyd, farthest-point init: plan.lloyd) and the retrieved blocks of every
    query block: the `sink_blocks` first blocks that hold a real key (attention sinks) are exact for every later
    query block; of the other blocks before the local ones, block m is scored at the mean query of block n by
    the mass estimate `logsumexp_c(scale * qbar . mu_c + log n_c)` and the `topk_blocks` best are exact; then, of
    the blocks still left, the `peak_blocks` of highest peak score `max_j scale * qbar . k_j` (the block's best
    key: a block that holds one key the queries match, whose cell mean hides it).
    backend: "auto" (the Triton clustering and scoring of kernels/muse/cluster.py on CUDA, PyTorch elsewhere),
    "torch" or "triton"; both give the same plan up to near-ties (see cluster.py)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    L, Ck = block_size, k_clusters
    nb = max(1, math.ceil(S / L))
    Sp = nb * L
    dev = q.device
    key_valid = (torch.arange(Sp, device=dev) < S)[None].expand(B, Sp).clone()
    if key_mask is not None:
        key_valid[:, :S] &= key_mask.to(device=dev, dtype=torch.bool)
    vb = key_valid.view(B, 1, nb, L)
    kb = _blocks(k, L, Sp)  # [B, Hkv, nb, L, D]
    cent, ka, cnt = lloyd(kb.reshape(-1, L, D), vb.expand(B, Hkv, nb, L).reshape(-1, L), Ck,
                          kmeans_iters, backend=backend)
    cent = cent.view(B, Hkv, nb, Ck, D)
    cnt = cnt.view(B, Hkv, nb, Ck)
    retrieved = torch.zeros(B, Hq, nb, nb, dtype=torch.bool, device=dev)
    ar = torch.arange(nb, device=dev)
    far = ar[None, :] < ar[:, None] - local_blocks  # [n, m]
    first = vb.any(-1).view(B, nb).to(torch.int8).argmax(-1)  # each row's first block with a real key
    sink = (ar[None] >= first[:, None]) & (ar[None] < first[:, None] + sink_blocks)  # [B, nb]
    retrieved |= (far[None] & sink[:, None, :])[:, None]
    use_triton = backend == "triton" or (backend == "auto" and q.is_cuda)
    if (topk_blocks > 0 or peak_blocks > 0) and nb > local_blocks + 1:
        qb = _blocks(q, L, Sp)  # [B, Hq, nb, L, D]
        if key_mask is not None:
            qb = qb * vb[..., None].to(qb.dtype)
        qbar = qb.sum(3, dtype=torch.float32) / vb.sum(3, dtype=torch.float32).clamp_min(1)[..., None]
    if topk_blocks > 0 and nb > local_blocks + 1:
        logn = log_counts(cnt)
        kk = min(topk_blocks, nb)
        if use_triton and block_scores_supported(D, Ck):
            bs = block_scores_triton(qbar, cent, logn, scale=scale, local_blocks=local_blocks)
            _take_top(retrieved, bs.masked_fill_(sink[:, None, None, :], -math.inf), kk)
        else:
            step = max(1, chunk_elems // max(1, B * G * nb * Ck))  # query blocks per scoring chunk
            for g in range(Hkv):
                for n0 in range(0, nb, step):
                    n1 = min(nb, n0 + step)
                    sc = scale * torch.einsum("bhnd,bmcd->bhnmc", qbar[:, g * G:(g + 1) * G, n0:n1], cent[:, g])
                    bs = torch.logsumexp(sc + logn[:, g][:, None, None], -1)  # [B, G, n, m]
                    bs = bs.masked_fill(~far[n0:n1][None, None] | sink[:, None, None, :], -math.inf)
                    _take_top(retrieved[:, g * G:(g + 1) * G, n0:n1], bs, kk)
    if peak_blocks > 0 and nb > local_blocks + 1:
        if use_triton and block_peaks_supported(k, L, G):
            ps = block_peaks_triton(qbar, kb, key_valid, scale=scale, local_blocks=local_blocks)
        else:
            ps = block_peaks(qbar, kb, key_valid, scale=scale, local_blocks=local_blocks,
                             chunk_elems=chunk_elems)
        _take_top(retrieved, ps.masked_fill_(retrieved, -math.inf), min(peak_blocks, nb))
    return CellsPlan(L, Ck, local_blocks, Sp, nb, ka.view(B, Hkv, Sp), cnt, key_valid, retrieved,
                     min(topk_blocks + peak_blocks + sink_blocks, nb), key_mask is not None)


def _take_top(retrieved, scores, k: int) -> None:
    """Marks in `retrieved` (in place; it may be a view) the k best blocks of each row of `scores` that score above
    -inf (-inf: not a candidate)."""
    val, idx = scores.topk(k, -1)
    retrieved.scatter_(-1, idx, torch.isfinite(val) | retrieved.gather(-1, idx))


def block_peaks(qbar, kb, key_valid, *, scale: float, local_blocks: int, chunk_elems: int = 2**26) -> torch.Tensor:
    """The peak score `max_j scale * qbar_n . k_j` over the real keys j of block m, for m < n - local_blocks (else,
    or with no real key, -inf), with the mean query rounded to the keys' dtype (the scores only rank blocks; bf16
    keys then take one exact bf16 product). qbar [B, Hq, nb, D] fp32, kb [B, Hkv, nb, L, D], key_valid [B, nb * L]
    bool -> [B, Hq, nb, nb] fp32 (PyTorch; block_peaks_triton computes the same)."""
    B, Hq, nb, D = qbar.shape
    Hkv, L = kb.shape[1], kb.shape[3]
    G = Hq // Hkv
    ar = torch.arange(nb, device=qbar.device)
    far = ar[None, :] < ar[:, None] - local_blocks
    kv = key_valid.view(B, 1, 1, nb, L)
    out = torch.empty(B, Hq, nb, nb, device=qbar.device, dtype=torch.float32)
    step = max(1, chunk_elems // max(1, B * G * nb * L))
    qbar = qbar.to(kb.dtype).float()
    for g in range(Hkv):
        kg = kb[:, g].float()
        for n0 in range(0, nb, step):
            n1 = min(nb, n0 + step)
            s = torch.einsum("bhnd,bmld->bhnml", qbar[:, g * G:(g + 1) * G, n0:n1], kg)
            s = (scale * s).masked_fill_(~kv, -math.inf).amax(-1)
            out[:, g * G:(g + 1) * G, n0:n1] = s.masked_fill_(~far[n0:n1], -math.inf)
    return out


def cell_summaries(k, v, plan: CellsPlan):
    """Mean key and mean value of every cell, differentiable in k and v: [B, Hkv, nb, Ck, D] each, in k's dtype
    (each key's weight 1 / n_cell rounded to it; a bf16 mean takes one rounding, the matmul accumulates in fp32)."""
    L, Ck, Sp = plan.block_size, plan.k_clusters, plan.padded_len
    B, Hkv = k.shape[:2]
    inv = 1.0 / plan.counts.clamp_min(1)  # [B, Hkv, nb, Ck]
    w = torch.nn.functional.one_hot(plan.k_assign, Ck).view(B, Hkv, plan.num_blocks, L, Ck) * inv[:, :, :, None]
    w = (w * plan.key_valid.view(B, 1, plan.num_blocks, L, 1)).to(k.dtype)
    mu = torch.einsum("bhmlc,bhmld->bhmcd", w, _blocks(k, L, Sp))
    vbar = torch.einsum("bhmlc,bhmld->bhmcd", w, _blocks(v, L, Sp))
    return mu, vbar


def cells_reference(q, k, v, plan: CellsPlan, *, scale: float, chunk_elems: int = 2**26) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D] (computed in float32, or float64 for float64)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    L, Ck, nb, Sp, loc = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len, plan.local_blocks
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    mu, vbar = cell_summaries(k.to(ct), v.to(ct), plan)
    mu = mu.repeat_interleave(G, 1).flatten(2, 3)  # [B, Hq, nb*Ck, D]
    vbar = vbar.repeat_interleave(G, 1).flatten(2, 3)
    logn = plan.counts.clamp_min(1).log().to(ct).repeat_interleave(G, 1).flatten(2)  # [B, Hq, nb*Ck]
    cell_ok = (plan.counts > 0).repeat_interleave(G, 1).flatten(2)
    Q = torch.nn.functional.pad(q.to(ct), (0, 0, 0, Sp - S))
    K = torch.nn.functional.pad(k.to(ct), (0, 0, 0, Sp - S)).repeat_interleave(G, 1)
    V = torch.nn.functional.pad(v.to(ct), (0, 0, 0, Sp - S)).repeat_interleave(G, 1)
    pos = torch.arange(Sp, device=q.device)
    kblk = pos // L
    cblk = torch.arange(nb * Ck, device=q.device) // Ck
    step = max(1, chunk_elems // max(1, B * Hq * L * (Sp + nb * Ck)))
    outs = []
    for n0 in range(0, nb, step):
        n1 = min(nb, n0 + step)
        t = pos[n0 * L:n1 * L]
        n = t // L  # [T]
        R = plan.retrieved[:, :, n]  # [B, Hq, T, nb]
        exact = ((kblk[None] == n[:, None]) & (pos[None] <= t[:, None])) \
            | ((kblk[None] < n[:, None]) & (kblk[None] >= n[:, None] - loc))  # [T, Sp]
        exact = (exact[None, None] | torch.gather(R, -1, kblk.expand(B, Hq, len(t), Sp))) \
            & plan.key_valid[:, None, None, :]
        far = cblk[None] < n[:, None] - loc  # [T, nb*Ck]
        summ = far[None, None] & ~torch.gather(R, -1, cblk.expand(B, Hq, len(t), nb * Ck)) & cell_ok[:, :, None]
        se = (scale * Q[:, :, t] @ K.transpose(-1, -2)).masked_fill(~exact, -math.inf)
        sc = (scale * Q[:, :, t] @ mu.transpose(-1, -2) + logn[:, :, None]).masked_fill(~summ, -math.inf)
        p = masked_softmax(torch.cat([se, sc], -1))
        outs.append(p[..., :Sp] @ V + p[..., Sp:] @ vbar)
    out = torch.cat(outs, 2)[:, :, :S]
    return out.transpose(1, 2).to(q.dtype)


@triton.jit
def _mm(a, b, UP: tl.constexpr):
    """a @ b with fp32 accumulation. bf16/fp16 operands: one tensor-core dot. fp32 operands: tf32x3 (each operand
    split in a tf32 high part and a tf32 remainder, three tensor-core products), within a few fp32 ulps of ieee
    products; ieee fp32 dots compile to FMA loops that spill on sm_90. UP: the interpreter's bf16 workaround
    (see triton_kernels._dot)."""
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _online(s, qk, vals, m_i, l_i, acc, EMPTY: tl.constexpr, UP: tl.constexpr):
    """One online-softmax step in the log2 domain: logits qk * s for the unscaled tile s [BM, BN] (so that the
    scale and the max subtraction are one FMA), values [BN, D]. EMPTY: a row of the tile may be all -inf with no
    earlier finite logit (a masked tile); without it the max is finite and needs no guard."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if EMPTY else m_new
    p = tl.exp2(s * qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + _mm(p.to(vals.dtype), vals, UP)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


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
    return mu, vb, _mm(q, tl.trans(mu), UP) + bias[None, :]


@triton.jit
def _exact_tile(K, V, KVAL, q, b, kvh, Sp, pos0, offs_m, offs_n, offs_d, MASK: tl.constexpr, D: tl.constexpr,
                UP: tl.constexpr):
    """Exact keys pos0 .. pos0 + BN: keys, values and the unscaled logits q.k of the query tile q. MASK 0: none
    (full earlier blocks without a key mask), 1: -inf for padding, 2: also for keys after the query (own block)."""
    pos = pos0 + offs_n
    k = tl.load(K + (kvh * Sp + pos)[:, None] * D + offs_d[None, :])
    v = tl.load(V + (kvh * Sp + pos)[:, None] * D + offs_d[None, :])
    s = _mm(q, tl.trans(k), UP)
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
               PAD: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr):
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
    # far field: the cells of blocks 0 .. n - LOC - 1, minus the retrieved blocks
    hi = tl.maximum(n - LOC, 0) * CK
    for c0 in range(0, hi, BN):
        _, vb, s = _cell_tile(MU, VB, LOGN, RET, q, scale, bh, kvh, n, NB, NCK, c0, hi, offs_n, offs_d, CK, D, UP)
        m_i, l_i, acc = _online(s, qk, vb, m_i, l_i, acc, True, UP)
    # exact: the listed earlier blocks (retrieved and local), one flat loop over (block, key tile) so that the
    # loads pipeline across blocks; then the own block up to the tile's last query, causally
    row = bh * NB + n
    for it in range(0, _list_len(EXL, row, NE, NEP) * (L // BN)):
        mblk = tl.load(EXL + row * NE + it // (L // BN))
        _, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, mblk * L + (it % (L // BN)) * BN, offs_m, offs_n, offs_d,
                              PAD, D, UP)
        m_i, l_i, acc = _online(s, qk, v, m_i, l_i, acc, PAD > 0, UP)
    for k0 in range(0, (tile * BM) % L + BM, BN):
        _, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, n * L + k0, offs_m, offs_n, offs_d, 2, D, UP)
        m_i, l_i, acc = _online(s, qk, v, m_i, l_i, acc, True, UP)
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


@triton.jit
def _p_ds(s, qk, lse2, do, vals, delta, UP: tl.constexpr):
    """Row-major pair [BM queries, BN keys] of unscaled logits s: probabilities and dS = P * (dO V^T - Delta)."""
    p = tl.exp2(s * qk - lse2[:, None])
    dp = _mm(do, tl.trans(vals), UP)
    return p, p * (dp - delta[:, None])


@triton.jit
def _cells_bwd_dq(Q, K, V, MU, VB, LOGN, KVAL, EXL, RET, DO, LSE, DELTA, DQ, scale, H, HKV, NB, Sp, NCK,
                  L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, NE: tl.constexpr, NEP: tl.constexpr,
                  PAD: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr):
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
    hi = tl.maximum(n - LOC, 0) * CK
    for c0 in range(0, hi, BN):
        mu, vb, s = _cell_tile(MU, VB, LOGN, RET, q, scale, bh, kvh, n, NB, NCK, c0, hi, offs_n, offs_d, CK, D, UP)
        p, ds = _p_ds(s, qk, lse2, do, vb, delta, UP)
        dq += _mm(ds.to(mu.dtype), mu, UP)
    row = bh * NB + n
    for it in range(0, _list_len(EXL, row, NE, NEP) * (L // BN)):
        mblk = tl.load(EXL + row * NE + it // (L // BN))
        k, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, mblk * L + (it % (L // BN)) * BN, offs_m, offs_n, offs_d,
                              PAD, D, UP)
        p, ds = _p_ds(s, qk, lse2, do, v, delta, UP)
        dq += _mm(ds.to(k.dtype), k, UP)
    for k0 in range(0, (tile * BM) % L + BM, BN):
        k, v, s = _exact_tile(K, V, KVAL, q, b, kvh, Sp, n * L + k0, offs_m, offs_n, offs_d, 2, D, UP)
        p, ds = _p_ds(s, qk, lse2, do, v, delta, UP)
        dq += _mm(ds.to(k.dtype), k, UP)
    tl.store(DQ + (bh * Sp + offs_m)[:, None] * D + offs_d[None, :], dq * scale)


@triton.jit
def _cells_bwd_dkdv(Q, K, V, KVAL, RET, DO, LSE, DELTA, DK, DV, scale, H, HKV, NB, Sp,
                    L: tl.constexpr, LOC: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    UP: tl.constexpr):
    """dK, dV of the exact keys: one program per (BN keys of block m, batch x kv head), over the query blocks that
    attend block m exactly (its own block causally, the LOC blocks after it, and those that retrieved it)."""
    kt = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    G = H // HKV
    b = bkv // HKV
    hk = bkv % HKV
    offs_n = kt * BN + tl.arange(0, BN)
    m = (kt * BN) // L
    offs_d = tl.arange(0, D)
    offs_q = tl.arange(0, BM)
    qk = scale * 1.4426950408889634
    k = tl.load(K + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :])
    v = tl.load(V + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :])
    kv = tl.load(KVAL + b * Sp + offs_n) != 0
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    for g in range(G):
        bh = b * H + hk * G + g
        for n in range(m, NB):
            exact = (n - m <= LOC) | (tl.load(RET + (bh * NB + n) * NB + m) != 0)
            if exact:
                for q0 in range(0, L, BM):
                    qpos = n * L + q0 + offs_q
                    q = tl.load(Q + (bh * Sp + qpos)[:, None] * D + offs_d[None, :])
                    do = tl.load(DO + (bh * Sp + qpos)[:, None] * D + offs_d[None, :])
                    lse2 = tl.load(LSE + bh * Sp + qpos) * 1.4426950408889634
                    delta = tl.load(DELTA + bh * Sp + qpos)
                    ok = kv[None, :] & ((n != m) | (offs_n[None, :] <= qpos[:, None]))
                    s = tl.where(ok, _mm(q, tl.trans(k), UP), float("-inf"))
                    p, ds = _p_ds(s, qk, lse2, do, v, delta, UP)
                    dv += _mm(tl.trans(p.to(do.dtype)), do, UP)
                    dk += _mm(tl.trans(ds.to(q.dtype)), q, UP)
    tl.store(DK + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :], dk * scale)
    tl.store(DV + (bkv * Sp + offs_n)[:, None] * D + offs_d[None, :], dv)


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
                s = tl.where(okn[None, :], _mm(q, tl.trans(mu), UP) + bias[None, :], float("-inf"))
                p, ds = _p_ds(s, qk, lse2, do, vb, delta, UP)
                dvb += _mm(tl.trans(p.to(do.dtype)), do, UP)
                dmu += _mm(tl.trans(ds.to(q.dtype)), q, UP)
    tl.store(DMU + (bkv * NCK + cidx)[:, None] * D + offs_d[None, :], dmu * scale, mask=okc[:, None])
    tl.store(DVB + (bkv * NCK + cidx)[:, None] * D + offs_d[None, :], dvb, mask=okc[:, None])


# forward tiles by (head_dim, dtype) that replace cells_tiles' choice: (BM, BN, warps, stages); for benchmarks
FWD_TILES: dict = {}


def cells_tiles(D: int, dtype: torch.dtype, L: int) -> dict:
    """Launch tiles of the cells kernels: fwd (query tile BM, key tile BN, warps, stages) and bwd (BM, BN, warps,
    query tile of the dK/dV and dcells kernels). bf16/fp16: the fastest forward of an H200 sweep
    (evals/bench_muse_cells.py `tune`), and backward tiles that compile without register spills for sm_90
    (128 x 64, 8 warps). fp32 (tf32x3 dots): tiles that fit sm_90's shared memory with the fewest spills
    (cuobjdump of the sm_90 build). BM and BN divide block_size L (a multiple of 128)."""
    if dtype == torch.float32:  # tf32x3 dots keep two tf32 copies of every operand in shared memory
        fwd, bwd = ((128, 64, 8, 1), (64, 32, 4, 32)) if D >= 128 else ((64, 64, 4, 2), (64, 64, 8, 32))
    else:
        fwd, bwd = ((128, 128, 8, 3) if D >= 128 else (128, 128, 4, 2)), (128, 64, 8, 128)
    fm, fn, fw, fs = FWD_TILES.get((D, dtype), fwd)
    return dict(fwd=(min(fm, L), min(fn, L), fw, fs), bwd=tuple(min(t, L) if i != 2 else t for i, t in enumerate(bwd)))


def _padded(t: torch.Tensor, Sp: int) -> torch.Tensor:
    """t [B, H, S, D] zero-padded to Sp positions, contiguous (no copy when it already is both)."""
    if t.shape[2] != Sp:
        t = torch.nn.functional.pad(t, (0, 0, 0, Sp - t.shape[2]))
    return t.contiguous()


class _CellsAttention(torch.autograd.Function):
    """The cells attention with the plan fixed: inputs q, k, v (exact keys) and the cell means mu, vbar
    ([B, Hkv, nb, Ck, D], differentiable functions of k and v computed outside by `cell_summaries`)."""

    @staticmethod
    def forward(ctx, q, k, v, mu, vbar, plan: CellsPlan, scale: float):
        B, Hq, S, D = q.shape
        Hkv = k.shape[1]
        L, Ck, nb, Sp = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len
        tiles = cells_tiles(D, q.dtype, L)
        MU = mu.reshape(B * Hkv, nb * Ck, D).contiguous()
        VB = vbar.reshape(B * Hkv, nb * Ck, D).contiguous()
        logn = log_counts(plan.counts).reshape(B * Hkv, nb * Ck).contiguous()
        Q, K, V = (_padded(t, Sp) for t in (q, k, v))
        exl = exact_lists(plan)
        # the list kernels' constants; PAD: the listed blocks may hold masked keys (a key mask was given)
        lists = dict(NE=exl.shape[-1], NEP=triton.next_power_of_2(exl.shape[-1]), PAD=int(plan.key_masked))
        ret = plan.retrieved.to(torch.int8).contiguous()
        kval = plan.key_valid.to(torch.int8).contiguous()
        O = torch.empty_like(Q)
        LSE = torch.empty(B, Hq, Sp, device=q.device, dtype=torch.float32)
        up = os.environ.get("TRITON_INTERPRET") == "1" and q.dtype != torch.float32
        fm, fn, fw, fs = tiles["fwd"]
        _cells_fwd[(B * Hq, Sp // fm)](
            Q, K, V, MU, VB, logn, kval, exl, ret, O, LSE, scale, Hq, Hkv, nb, Sp, nb * Ck,
            L=L, CK=Ck, LOC=plan.local_blocks, **lists, D=D, BM=fm, BN=fn, UP=up, num_warps=fw, num_stages=fs)
        ctx.save_for_backward(Q, K, V, MU, VB, O, LSE, logn, exl, ret, kval)
        ctx.meta = (B, Hq, Hkv, S, D, L, Ck, nb, Sp, plan.local_blocks, lists, tiles["bwd"], up, scale)
        return O[:, :, :S].transpose(1, 2)

    @staticmethod
    def backward(ctx, do):
        Q, K, V, MU, VB, O, LSE, logn, exl, ret, kval = ctx.saved_tensors
        B, Hq, Hkv, S, D, L, Ck, nb, Sp, loc, lists, (BM, BN, warps, BMK), up, scale = ctx.meta
        DO = _padded(do.transpose(1, 2).to(Q.dtype), Sp)
        DELTA = (DO.float() * O.float()).sum(-1).contiguous()
        f32 = dict(device=Q.device, dtype=torch.float32)
        DQ = torch.empty(B, Hq, Sp, D, **f32)
        DK = torch.empty(B, Hkv, Sp, D, **f32)
        DV = torch.empty(B, Hkv, Sp, D, **f32)
        DMU = torch.empty(B * Hkv, nb * Ck, D, **f32)
        DVB = torch.empty(B * Hkv, nb * Ck, D, **f32)
        _cells_bwd_dq[(Sp // BM, B * Hq)](
            Q, K, V, MU, VB, logn, kval, exl, ret, DO, LSE, DELTA, DQ, scale, Hq, Hkv, nb, Sp, nb * Ck,
            L=L, CK=Ck, LOC=loc, **lists, D=D, BM=BM, BN=BN, UP=up, num_warps=warps, num_stages=1)
        _cells_bwd_dkdv[(Sp // BN, B * Hkv)](
            Q, K, V, kval, ret, DO, LSE, DELTA, DK, DV, scale, Hq, Hkv, nb, Sp,
            L=L, LOC=loc, D=D, BM=BMK, BN=BN, UP=up, num_warps=warps, num_stages=1)
        _cells_bwd_dcells[(triton.cdiv(nb * Ck, BN), B * Hkv)](
            Q, MU, VB, logn, ret, DO, LSE, DELTA, DMU, DVB, scale, Hq, Hkv, nb, Sp, nb * Ck,
            L=L, CK=Ck, LOC=loc, D=D, BM=BMK, BN=BN, UP=up, num_warps=warps, num_stages=1)
        cast = lambda t, like: t.to(like.dtype)  # noqa: E731
        return (cast(DQ[:, :, :S], Q), cast(DK[:, :, :S], K), cast(DV[:, :, :S], V),
                cast(DMU.view(B, Hkv, nb, Ck, D), MU), cast(DVB.view(B, Hkv, nb, Ck, D), VB), None, None)


def cells_triton(q, k, v, plan: CellsPlan, *, scale: float) -> torch.Tensor:
    """`cells_reference` through the Triton kernels (forward, and the backward when gradients are needed).
    q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D]. Needs `block_size` a multiple of 128 and D a power
    of two. q, k and v share one dtype (`muse_attention` casts mixed inputs). The cell means are computed
    (differentiably) in that dtype with fp32 accumulation, and kept in it under autocast."""
    mu, vbar = cell_summaries(k, v, plan)
    return _CellsAttention.apply(q, k, v, mu.to(q.dtype), vbar.to(q.dtype), plan, scale)
