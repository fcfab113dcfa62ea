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
- `ops.cells_triton`: the Triton kernels of `triton_cells.py` in an `autograd.Function`. Forward: one program per
  (128-query tile, batch x query head) runs one online softmax over the cell keys of the far blocks (a contiguous
  `[nb * Ck, D]` array, with `log n` as a bias and the retrieved blocks masked), the retrieved and local blocks (a
  per-query-block list) and its own block (causal). Backward (FlashAttention-2 scheme, recomputing P from the saved
  LSE, no atomics): dQ per query tile; dK/dV per exact key tile over the query blocks that attend it exactly;
  dMU/dVB per cell tile over the query blocks that summarise it; the cell means' gradients reach k and v through
  `cell_summaries` (autograd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backend import resolve_backend
from .plan import block_view, lloyd, log_counts
from .reference import masked_softmax
from .support import block_peaks_supported, block_scores_supported


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
    backend: "auto" (the Triton clustering and scoring of kernels/muse/triton_cluster.py on CUDA, PyTorch elsewhere),
    "torch" or "triton"; both give the same plan up to near-ties (see triton_cluster.py)."""
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
    kb = block_view(k, L, Sp)  # [B, Hkv, nb, L, D]
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
    use_triton = resolve_backend(backend, q, k, what="muse plan") == "triton"
    if use_triton:
        from .triton_cluster import block_peaks_triton, block_scores_triton, mark_top_supported
    mark_triton = use_triton and mark_top_supported(nb)
    if (topk_blocks > 0 or peak_blocks > 0) and nb > local_blocks + 1:
        qb = block_view(q, L, Sp)  # [B, Hq, nb, L, D]
        if key_mask is not None:
            qb = qb * vb[..., None].to(qb.dtype)
        qbar = qb.sum(3, dtype=torch.float32) / vb.sum(3, dtype=torch.float32).clamp_min(1)[..., None]
    if topk_blocks > 0 and nb > local_blocks + 1:
        logn = log_counts(cnt)
        kk = min(topk_blocks, nb)
        if use_triton and block_scores_supported(D, Ck):
            bs = block_scores_triton(qbar, cent, logn, scale=scale, local_blocks=local_blocks)
            take_top(retrieved, bs, kk, triton=mark_triton)  # the sinks: already marked
        else:
            step = max(1, chunk_elems // max(1, B * G * nb * Ck))  # query blocks per scoring chunk
            for g in range(Hkv):
                for n0 in range(0, nb, step):
                    n1 = min(nb, n0 + step)
                    sc = scale * torch.einsum("bhnd,bmcd->bhnmc", qbar[:, g * G:(g + 1) * G, n0:n1], cent[:, g])
                    bs = torch.logsumexp(sc + logn[:, g][:, None, None], -1)  # [B, G, n, m]
                    bs = bs.masked_fill(~far[n0:n1][None, None], -math.inf)  # sinks: already marked
                    take_top(retrieved[:, g * G:(g + 1) * G, n0:n1], bs, kk)
    if peak_blocks > 0 and nb > local_blocks + 1:
        if use_triton and block_peaks_supported(k, L, G):
            ps = block_peaks_triton(qbar, kb, key_valid, scale=scale, local_blocks=local_blocks)
        else:
            ps = block_peaks(qbar, kb, key_valid, scale=scale, local_blocks=local_blocks,
                             chunk_elems=chunk_elems)
        take_top(retrieved, ps, min(peak_blocks, nb), triton=mark_triton)
    return CellsPlan(L, Ck, local_blocks, Sp, nb, ka.view(B, Hkv, Sp), cnt, key_valid, retrieved,
                     min(topk_blocks + peak_blocks + sink_blocks, nb), key_mask is not None)


def list_plan(retrieved: torch.Tensor, key_valid: torch.Tensor, *, block_size: int, max_listed: int) -> CellsPlan:
    """A plan without a far field (no cells): query block n attends exactly to the earlier blocks m with
    `retrieved[b, h, n, m]` and to its own block causally, nothing else (MoBA's block gating, kernels/moba).
    retrieved [B, Hq, nb, nb] bool (True only for m < n), key_valid [B, nb * block_size] bool, with the real keys of
    every listed block all real (only the own block's masked keys are masked); max_listed: an upper bound on
    retrieved.sum(-1)."""
    B, nb = retrieved.shape[0], retrieved.shape[2]
    empty = retrieved.new_zeros(B, 0, dtype=torch.float32)
    return CellsPlan(block_size, 0, 0, nb * block_size, nb, empty, empty, key_valid, retrieved,
                     min(max_listed, nb))


def take_top(retrieved, scores, k: int, triton: bool = False) -> None:
    """Marks in `retrieved` (in place; it may be a view) the k best blocks of each row of `scores` among those not yet
    marked that score above -inf (-inf: not a candidate). triton: one kernel (`triton_cluster.mark_top_triton`;
    CUDA, `retrieved` contiguous and as shaped as `scores`, ties to the lowest index) instead of PyTorch's top-k."""
    if triton:
        from .triton_cluster import mark_top_triton

        mark_top_triton(retrieved, scores, k)
        return
    val, idx = scores.masked_fill(retrieved, -math.inf).topk(k, -1)
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
    mu = torch.einsum("bhmlc,bhmld->bhmcd", w, block_view(k, L, Sp))
    vbar = torch.einsum("bhmlc,bhmld->bhmcd", w, block_view(v, L, Sp))
    return mu, vbar


def chunk_masks(plan: CellsPlan, t: torch.Tensor):
    """For the query positions t [T]: the keys each one attends exactly, [B, Hq, T, Sp] (its own block causally, the
    local blocks, the retrieved ones; real keys only), and the cells it sees through the far field, [B, Hq, T, nb * Ck]
    (the blocks before the local ones that are not retrieved). The references' masks (cells, tilted-cells)."""
    L, Ck, nb, Sp, loc = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len, plan.local_blocks
    pos = torch.arange(Sp, device=t.device)
    kblk = pos // L
    cblk = torch.arange(nb * Ck, device=t.device) // Ck
    n = t // L
    R = plan.retrieved[:, :, n]  # [B, Hq, T, nb]
    B, Hq = R.shape[:2]
    exact = ((kblk[None] == n[:, None]) & (pos[None] <= t[:, None])) \
        | ((kblk[None] < n[:, None]) & (kblk[None] >= n[:, None] - loc))  # [T, Sp]
    exact = (exact[None, None] | torch.gather(R, -1, kblk.expand(B, Hq, len(t), Sp))) & plan.key_valid[:, None, None, :]
    far = (cblk[None] < n[:, None] - loc)[None, None] & ~torch.gather(R, -1, cblk.expand(B, Hq, len(t), nb * Ck))
    return exact, far


def cells_reference(q, k, v, plan: CellsPlan, *, scale: float, chunk_elems: int = 2**26) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D] (computed in float32, or float64 for float64)."""
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    L, Ck, nb, Sp = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len
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
    step = max(1, chunk_elems // max(1, B * Hq * L * (Sp + nb * Ck)))
    outs = []
    for n0 in range(0, nb, step):
        n1 = min(nb, n0 + step)
        t = pos[n0 * L:n1 * L]
        exact, far = chunk_masks(plan, t)
        summ = far & cell_ok[:, :, None]
        se = (scale * Q[:, :, t] @ K.transpose(-1, -2)).masked_fill(~exact, -math.inf)
        sc = (scale * Q[:, :, t] @ mu.transpose(-1, -2) + logn[:, :, None]).masked_fill(~summ, -math.inf)
        p = masked_softmax(torch.cat([se, sc], -1))
        outs.append(p[..., :Sp] @ V + p[..., Sp:] @ vbar)
    out = torch.cat(outs, 2)[:, :, :S]
    return out.transpose(1, 2).to(q.dtype)
