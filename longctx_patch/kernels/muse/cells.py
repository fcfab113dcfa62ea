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
- `cells_triton`: a Triton forward (no gradient): one program per (128-query tile, batch x query head) runs one
  online softmax over the cell keys of the far blocks (a contiguous `[nb * Ck, D]` array, with `log n` as a
  bias and the retrieved blocks masked), the retrieved and local blocks (a per-query-block list) and its own
  block (causal).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .plan import _blocks, lloyd


@dataclass
class CellsPlan:
    block_size: int
    k_clusters: int
    local_blocks: int
    seq_len: int
    padded_len: int
    num_blocks: int
    k_assign: torch.Tensor  # [B, Hkv, Sp] int64: cell of each key within its block
    counts: torch.Tensor  # [B, Hkv, nb, Ck] float32: real keys per cell
    key_valid: torch.Tensor  # [B, Sp] bool
    retrieved: torch.Tensor  # [B, Hq, nb, nb] bool: block m attended exactly by query block n (local excluded)


@torch.no_grad()
def make_cells_plan(q, k, *, scale: float, block_size: int = 256, k_clusters: int = 32, kmeans_iters: int = 2,
                    topk_blocks: int = 8, local_blocks: int = 1, key_mask: torch.Tensor | None = None,
                    chunk_elems: int = 2**26) -> CellsPlan:
    """Key cells per block and kv head (Lloyd, farthest-point init: plan.lloyd) and the retrieved blocks of every
    query block: block m is scored at the mean query of block n by `logsumexp_c(scale * qbar . mu_c + log n_c)`
    and the `topk_blocks` best blocks before the local ones are exact."""
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
    cent, ka, cnt = lloyd(_blocks(k, L, Sp).reshape(-1, L, D), vb.expand(B, Hkv, nb, L).reshape(-1, L), Ck,
                          kmeans_iters)
    cent = cent.view(B, Hkv, nb, Ck, D)
    cnt = cnt.view(B, Hkv, nb, Ck)
    retrieved = torch.zeros(B, Hq, nb, nb, dtype=torch.bool, device=dev)
    if topk_blocks > 0 and nb > local_blocks + 1:
        qb = _blocks(q.float(), L, Sp)  # [B, Hq, nb, L, D]
        qv = vb.to(torch.float32)[..., None]  # [B, 1, nb, L, 1]
        qbar = (qb * qv).sum(3) / qv.sum(3).clamp_min(1)  # [B, Hq, nb, D]
        logn = torch.where(cnt > 0, cnt.clamp_min(1).log(), torch.full_like(cnt, -math.inf))
        ar = torch.arange(nb, device=dev)
        far = ar[None, :] < ar[:, None] - local_blocks  # [n, m]
        step = max(1, chunk_elems // max(1, B * G * nb * Ck))  # query blocks per scoring chunk
        for g in range(Hkv):
            for n0 in range(0, nb, step):
                n1 = min(nb, n0 + step)
                sc = scale * torch.einsum("bhnd,bmcd->bhnmc", qbar[:, g * G:(g + 1) * G, n0:n1], cent[:, g])
                bs = torch.logsumexp(sc + logn[:, g][:, None, None], -1)  # [B, G, n, m]
                bs = bs.masked_fill(~far[n0:n1][None, None], -math.inf)
                val, idx = bs.topk(min(topk_blocks, nb), -1)
                retrieved[:, g * G:(g + 1) * G, n0:n1].scatter_(-1, idx, torch.isfinite(val))
    return CellsPlan(L, Ck, local_blocks, S, Sp, nb, ka.view(B, Hkv, Sp), cnt, key_valid, retrieved)


def cell_summaries(k, v, plan: CellsPlan):
    """Mean key and mean value of every cell, differentiable in k and v: [B, Hkv, nb, Ck, D] each."""
    L, Ck, Sp = plan.block_size, plan.k_clusters, plan.padded_len
    B, Hkv = k.shape[:2]
    oh = torch.nn.functional.one_hot(plan.k_assign, Ck).to(k.dtype)
    oh = (oh * plan.key_valid[:, None, :, None].to(k.dtype)).view(B, Hkv, plan.num_blocks, L, Ck)
    inv = (1.0 / plan.counts.clamp_min(1)).to(k.dtype)[..., None]
    mu = torch.einsum("bhmlc,bhmld->bhmcd", oh, _blocks(k, L, Sp)) * inv
    vbar = torch.einsum("bhmlc,bhmld->bhmcd", oh, _blocks(v, L, Sp)) * inv
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
        logits = torch.cat([se, sc], -1)
        mx = logits.amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
        p = torch.exp(logits - mx)
        den = p.sum(-1, keepdim=True)
        p = p / torch.where(den > 0, den, torch.ones_like(den))
        outs.append(p[..., :Sp] @ V + p[..., Sp:] @ vbar)
    out = torch.cat(outs, 2)[:, :, :S]
    return out.transpose(1, 2).to(q.dtype)


@triton.jit
def _cells_fwd(Q, K, V, MU, VB, LOGN, KVAL, EXL, RET, O, LSE, scale, H, HKV, NB, Sp, NCK,
               L: tl.constexpr, CK: tl.constexpr, LOC: tl.constexpr, NE: tl.constexpr, D: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, UP: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
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
        cidx = c0 + offs_n
        ok = cidx < hi
        cb = cidx // CK
        ok = ok & (tl.load(RET + (bh * NB + n) * NB + cb, mask=ok, other=1) == 0)
        mu = tl.load(MU + (kvh * NCK + cidx)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        bias = tl.load(LOGN + kvh * NCK + cidx, mask=ok, other=float("-inf")) * 1.4426950408889634
        s = _mm(q, tl.trans(mu), UP) * qk + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(VB + (kvh * NCK + cidx)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(vb.dtype), vb, UP)
        m_i = m_new
    # exact: the listed earlier blocks (retrieved and local; -1 = none), then the own block causally
    for e in range(NE + 1):
        if e < NE:
            mblk = tl.load(EXL + (bh * NB + n) * NE + e)
        else:
            mblk = n
        if mblk >= 0:
            kend = L
            if e == NE:
                kend = (tile * BM) % L + BM  # keys of the own block up to the tile's last query
            for k0 in range(0, kend, BN):
                pos = mblk * L + k0 + offs_n
                kv = tl.load(KVAL + b * Sp + pos) != 0
                k = tl.load(K + (kvh * Sp + pos)[:, None] * D + offs_d[None, :])
                s = _mm(q, tl.trans(k), UP) * qk
                ok = kv[None, :] & ((e < NE) | (pos[None, :] <= offs_m[:, None]))
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + (kvh * Sp + pos)[:, None] * D + offs_d[None, :])
                acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, UP)
                m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + (bh * Sp + offs_m)[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty))
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    tl.store(LSE + bh * Sp + offs_m, tl.where(has, (m_fin + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, 0.0))


@triton.jit
def _mm(a, b, UP: tl.constexpr):
    if UP:  # the CPU interpreter (3.9) mis-multiplies bf16 operands: upcast the already-rounded values
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision="ieee")


def exact_lists(plan: CellsPlan) -> torch.Tensor:
    """[B, Hq, nb, topk + local] int32: the earlier blocks each query block attends exactly (-1 pads)."""
    R = plan.retrieved.clone()
    nb, loc = plan.num_blocks, plan.local_blocks
    ar = torch.arange(nb, device=R.device)
    R |= ((ar[None, :] < ar[:, None]) & (ar[None, :] >= ar[:, None] - loc))[None, None]
    NE = max(1, int(R.sum(-1).max()))
    val, idx = R.to(torch.int8).topk(NE, dim=-1)  # the True blocks (order irrelevant)
    return torch.where(val > 0, idx, torch.full_like(idx, -1)).to(torch.int32).contiguous()


@torch.no_grad()
def cells_triton(q, k, v, plan: CellsPlan, *, scale: float, block_m: int = 128) -> torch.Tensor:
    """`cells_reference` as one Triton forward (no gradient). q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D].
    Needs `block_size` a multiple of `block_m` (128) and D a power of two."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    L, Ck, nb, Sp = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len
    BM = min(block_m, L)
    BN = 64 if D >= 128 else 128
    BN = min(BN, L)
    mu, vbar = cell_summaries(k.float(), v.float(), plan)
    mu = mu.to(q.dtype).reshape(B * Hkv, nb * Ck, D).contiguous()
    vbar = vbar.to(q.dtype).reshape(B * Hkv, nb * Ck, D).contiguous()
    logn = torch.where(plan.counts > 0, plan.counts.clamp_min(1).log(), torch.full_like(plan.counts, -math.inf))
    logn = logn.reshape(B * Hkv, nb * Ck).contiguous()
    pad = (0, 0, 0, Sp - S)
    Q = torch.nn.functional.pad(q, pad).contiguous()
    K = torch.nn.functional.pad(k, pad).contiguous()
    V = torch.nn.functional.pad(v, pad).contiguous()
    exl = exact_lists(plan)
    ret = plan.retrieved.to(torch.int8).contiguous()
    kval = plan.key_valid.to(torch.int8).contiguous()
    O = torch.empty_like(Q)
    LSE = torch.empty(B, Hq, Sp, device=q.device, dtype=torch.float32)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    _cells_fwd[(Sp // BM, B * Hq)](
        Q, K, V, mu, vbar, logn, kval, exl, ret, O, LSE, scale, Hq, Hkv, nb, Sp, nb * Ck,
        L=L, CK=Ck, LOC=plan.local_blocks, NE=exl.shape[-1], D=D, BM=BM, BN=BN,
        UP=interp and q.dtype != torch.float32, num_warps=8 if BM * D >= 128 * 128 else 4, num_stages=2)
    return O[:, :, :S].transpose(1, 2)
