"""MuSe planning step shared by the reference and the Triton path: clustering and retrieval.

Everything here is discrete (no gradient): cluster assignments, query-cluster centroids (the tilt
centres, treated as constants), key-cluster centroids/counts (only used to score cells for retrieval)
and the retrieval tables. Both backends consume the same `MusePlan`, so they compute the same function.

Shapes (nb = ceil(S / L) blocks, L = block_size, Sp = nb * L):
  q_centroids  [B, Hq, nb, Cq, D] float32   mean of the (real) queries assigned to each cluster
  q_assign     [B, Hq, Sp] int32           query cluster (0..Cq-1) of each position
  k_assign     [B, Hkv, Sp] int32          key cluster (0..Ck-1) of each position (within its block)
  key_valid    [B, Sp] bool                real key (inside the sequence and key_mask True)
  ret_block    [B, Hq, nb, Cq, nb] bool    block m retrieved exactly for query cluster (n, i)
  ret_cell     [B, Hq, nb, Cq, nb, Ck] bool cell (m, j) retrieved exactly for query cluster (n, i)
  ret_any      [B, Hq, nb, nb] bool        any cluster of query block n retrieves something of block m
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigError
from ..backend import resolve_backend
from .support import lloyd_supported


@dataclass
class MusePlan:
    block_size: int
    seq_len: int
    padded_len: int
    num_blocks: int
    q_centroids: torch.Tensor
    q_assign: torch.Tensor
    k_assign: torch.Tensor
    key_valid: torch.Tensor
    ret_block: torch.Tensor
    ret_cell: torch.Tensor
    ret_any: torch.Tensor


def log_counts(counts: torch.Tensor) -> torch.Tensor:
    """log of the members of each cluster, -inf for an empty one (a super-key's log-count bias)."""
    return torch.where(counts > 0, counts.clamp_min(1).log(), torch.full_like(counts, -math.inf))


def _init_centroids(x: torch.Tensor, valid: torch.Tensor, C: int) -> torch.Tensor:
    """Deterministic farthest-point init: the first valid token, then repeatedly the valid token farthest
    (squared L2) from the centroids chosen so far (ties: lowest position).

    x [N, L, D] float32, valid [N, L] bool -> [N, C, D] (zeros for a block with no valid token).
    """
    N, L, D = x.shape
    rows = torch.arange(N, device=x.device)
    first = valid.to(torch.int64).argmax(-1)  # first valid position (0 when none)
    x2 = (x * x).sum(-1)  # [N, L]

    def dist(c):  # squared distance of every token to c [N, D], as |x|^2 - 2 x.c + |c|^2 (one pass over x)
        return (x2 - 2 * torch.bmm(x, c[:, :, None])[..., 0] + (c * c).sum(-1)[:, None]).clamp_min(0)

    cent = [x[rows, first]]
    dmin = dist(cent[0])
    dmin[rows, first] = 0  # exactly: a chosen token is never the farthest (the expanded form rounds)
    neg = torch.full_like(dmin, -1.0)
    for _ in range(1, C):
        idx = torch.where(valid, dmin, neg).argmax(-1)
        c = x[rows, idx]
        cent.append(c)
        dmin = torch.minimum(dmin, dist(c))
        dmin[rows, idx] = 0
    out = torch.stack(cent, 1)
    return out * valid.any(-1).to(out.dtype)[:, None, None]


@torch.no_grad()
def lloyd(x: torch.Tensor, valid: torch.Tensor, C: int, iters: int, backend: str = "auto"):
    """Batched Lloyd k-means inside each block.

    x [N, L, D] (any float dtype; computed in float32), valid [N, L] bool.
    Returns centroids [N, C, D] float32 (mean of the members; an empty cluster keeps its previous value),
    assign [N, L] int64 (invalid tokens get cluster 0; they are masked everywhere) and counts [N, C] (valid members).
    Ties go to the lowest cluster index (argmax), so the result is deterministic.
    backend: "auto" (the Triton kernel `triton_cluster.lloyd_triton` on CUDA when it takes the shape, else this PyTorch
    code), "torch" or "triton".
    """
    if resolve_backend(backend, x, what="muse clustering") == "triton":
        from .triton_cluster import lloyd_triton

        why = lloyd_supported(x, C)
        if why is None:
            return lloyd_triton(x, valid, C, iters)
        if backend == "triton":
            raise ConfigError(f"muse clustering backend='triton' cannot run: {why}")
    xf = x.float()
    vf = valid.to(torch.float32)
    cent = _init_centroids(xf, valid, C)

    def assign_to(cent):
        score = 2 * torch.einsum("nld,ncd->nlc", xf, cent) - (cent * cent).sum(-1)[:, None, :]
        return score.argmax(-1)

    def update(a, cent):
        oh = torch.nn.functional.one_hot(a, C).to(torch.float32) * vf[:, :, None]
        cnt = oh.sum(1)  # [N, C]
        s = torch.einsum("nlc,nld->ncd", oh, xf)
        new = torch.where(cnt[:, :, None] > 0, s / cnt.clamp_min(1)[:, :, None], cent)
        return new, cnt

    for _ in range(iters):
        cent, _ = update(assign_to(cent), cent)
    a = assign_to(cent)
    cent, cnt = update(a, cent)
    return cent, a, cnt


def block_view(x: torch.Tensor, L: int, Sp: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, nb, L, D], zero-padded at the end."""
    B, H, S, D = x.shape
    if Sp != S:
        x = torch.nn.functional.pad(x, (0, 0, 0, Sp - S))
    return x.reshape(B, H, Sp // L, L, D)


@torch.no_grad()
def make_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    block_size: int = 64,
    q_clusters: int = 4,
    k_clusters: int = 4,
    kmeans_iters: int = 2,
    topk_clusters: int = 4,
    topk_blocks: int = 2,
    local_blocks: int = 1,
    key_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> MusePlan:
    """Clusters queries/keys per block and picks the exactly computed blocks/cells of each query cluster.

    q [B, Hq, S, D], k [B, Hkv, S, D] (post-rotary), key_mask [B, S] bool (True = real token) or None.
    The `local_blocks` blocks just before block n are always exact (the local neighbourhood, where most
    attention mass of language models sits). Retrieval scores a cell (m, j) for query cluster (n, i) by its
    monopole mass estimate `scale * c_ni . kc_mj + log count_mj`, a block by the log-sum-exp of its cells;
    for each query cluster the `topk_blocks` best other earlier blocks, then the `topk_clusters` best
    remaining earlier cells are exact. backend: of the clustering (`lloyd`).
    """
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    L = block_size
    nb = max(1, math.ceil(S / L))
    Sp = nb * L
    dev = q.device
    pos_ok = torch.arange(Sp, device=dev) < S
    key_valid = pos_ok[None, :].expand(B, Sp).clone()
    if key_mask is not None:
        km = key_mask.to(device=dev, dtype=torch.bool)
        key_valid[:, :S] &= km
    kv_blocks = key_valid.reshape(B, 1, nb, L)

    qb = block_view(q, L, Sp).reshape(B * Hq * nb, L, D)
    qvalid = kv_blocks.expand(B, Hq, nb, L).reshape(-1, L)
    qc, qa, _ = lloyd(qb, qvalid, q_clusters, kmeans_iters, backend)
    kb = block_view(k, L, Sp).reshape(B * Hkv * nb, L, D)
    kvalid = kv_blocks.expand(B, Hkv, nb, L).reshape(-1, L)
    kc, ka, kcnt = lloyd(kb, kvalid, k_clusters, kmeans_iters, backend)

    q_centroids = qc.reshape(B, Hq, nb, q_clusters, D)
    q_assign = qa.reshape(B, Hq, Sp).to(torch.int32)
    k_assign = ka.reshape(B, Hkv, Sp).to(torch.int32)
    kc = kc.reshape(B, Hkv, nb, k_clusters, D)
    kcnt = kcnt.reshape(B, Hkv, nb, k_clusters)

    G = Hq // Hkv
    ret_block = torch.zeros(B, Hq, nb, q_clusters, nb, dtype=torch.bool, device=dev)
    ret_cell = torch.zeros(B, Hq, nb, q_clusters, nb, k_clusters, dtype=torch.bool, device=dev)
    ar = torch.arange(nb, device=dev)
    causal = ar[None, :] < ar[:, None]  # [n, m]: m < n
    local = causal & (ar[None, :] >= ar[:, None] - local_blocks)  # [n, m]: n - local_blocks <= m < n
    ret_block |= local[None, None, :, None, :]
    if nb > 1 and (topk_blocks > 0 or topk_clusters > 0):
        logcnt = log_counts(kcnt)
        for h0 in range(0, Hq, G):  # one kv head (and its query group) at a time: bounded memory
            g = h0 // G
            sc = scale * torch.einsum("bhnid,bmjd->bhnimj", q_centroids[:, h0 : h0 + G], kc[:, g])
            sc = sc + logcnt[:, g][:, None, None, None]
            sc = sc.masked_fill(~(causal & ~local)[None, None, :, None, :, None], -math.inf)
            if topk_blocks > 0:
                bs = torch.logsumexp(sc, -1)  # [B, G, n, i, m]
                kk = min(topk_blocks, nb)
                val, idx = bs.topk(kk, dim=-1)
                rb = torch.zeros_like(bs, dtype=torch.bool).scatter_(-1, idx, torch.isfinite(val))
                ret_block[:, h0 : h0 + G] |= rb
                sc = sc.masked_fill(rb[..., None], -math.inf)
            if topk_clusters > 0:
                flat = sc.flatten(-2)
                kk = min(topk_clusters, flat.shape[-1])
                val, idx = flat.topk(kk, dim=-1)
                rc = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, torch.isfinite(val))
                ret_cell[:, h0 : h0 + G] = rc.view(sc.shape)
    ret_any = (ret_block | ret_cell.any(-1)).any(3)  # [B, Hq, n, m]
    return MusePlan(L, S, Sp, nb, q_centroids, q_assign, k_assign, key_valid, ret_block, ret_cell, ret_any)


def attended_keys(seq_len: int, *, far_field: str = "cells", block_size: int, k_clusters: int, topk_blocks: int,
                  peak_blocks: int = 0, local_blocks: int = 1, sink_blocks: int = 1, topk_clusters: int = 0,
                  **_) -> tuple[float, float]:
    """(exactly attended keys, super-keys) per query and head, averaged over the `seq_len` queries of one causal
    sequence without padding: the plan's key lists counted from the settings (the extra keyword arguments of
    `kernel_kwargs()`, such as q_clusters, are ignored). Query block n (of `block_size`) attends exactly to its own
    block causally, to `min(local_blocks, n)` blocks before it and, of its `far = n - local_blocks` far blocks, to
    `min(sink_blocks + topk_blocks + peak_blocks, far)` (cells, tilted-cells: the sinks, then the top-k by mass, then
    by peak; each step takes what is left); each other far block enters as `k_clusters` super-keys (an empty cell
    included: the kernels compute it too). `far_field="tilted"` retrieves per query cluster: `topk_blocks` blocks
    and `topk_clusters` cells of `block_size / k_clusters` keys on average. Equal to the cells plan's
    `retrieved.sum(-1)` (tests/test_muse_calibration.py)."""
    L, S = block_size, seq_len
    nb = max(1, math.ceil(S / L))
    exact = sup = 0.0
    for n in range(nb):
        c = min(L, S - n * L)  # queries of block n
        far = max(0, n - local_blocks)
        exact += c * (c + 1) / 2 + c * min(local_blocks, n) * L
        if far_field == "tilted":
            blocks = min(topk_blocks, far)
            cells = min(topk_clusters, (far - blocks) * k_clusters)
            exact += c * (blocks * L + cells * L / k_clusters)
            sup += c * ((far - blocks) * k_clusters - cells)
        else:
            ret = min(sink_blocks + topk_blocks + peak_blocks, far)
            exact += c * ret * L
            sup += c * (far - ret) * k_clusters
    return exact / S, sup / S
