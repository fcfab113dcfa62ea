"""MuSe's "tilted-cells" far field: the cells plan's exact part, with every far cell summarised for each query
cluster by its summary tilted at the cluster's centroid (docs/muse.md, section 8).

The cells far field (`reference_cells.py`) gives every query the same super-key per cell: its mean key and mean value. The
tilted design (sections 1-4) gives each query cluster of a block its own summary of each cell, tilted at the
cluster's centroid, which is more accurate but specific to one (query block, key block) pair: quadratic in blocks
with a large constant. Here the queries of each head are clustered *once over the whole sequence* (`q_clusters`
global clusters, Lloyd), so a tilted summary of a cell does not depend on the query block: each (cluster, cell)
pair is summarised once. Query t of cluster i (centroid c, rounded to the input dtype) sees far cell (m, j) as

    logit = lse_ij + scale * (q_t - c) . kt_ij        value = vt_ij
    with w_s = exp(scale * c . k_s) over the cell's real keys: lse = log sum w, kt = sum w k / sum w, vt = sum w v / sum w

the monopole of section 1 expanded at c. Everything else is the cells plan: the own block causally, the local
blocks, the sink blocks and the retrieved blocks exactly (`make_cells_plan`), the cells of every other earlier
block through their tilted summaries.

Two paths compute the same function from one `TiltPlan`:
- `tilted_cells_reference`: dense PyTorch per chunk of query blocks (any device, differentiable);
- `triton_tilted.tilted_cells_fwd`: the exact part on the cells kernels without a far field, then, per chunk of
  query heads, the summaries kernel and the far field over the queries sorted by cluster, which merges the two; its
  backward is `triton_tilted_bwd.tilted_cells_bwd`.

Cost (docs/muse.md section 8): the summaries are `q_clusters * S * 6 D` FLOP per head (linear in S); the far field
is, per query, one super-key per far cell of its cluster (as the cells'), computed once per cluster present in a tile
of queries sorted by cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backend import resolve_backend
from .reference_cells import CellsPlan, chunk_masks, make_cells_plan
from .plan import block_view
from .reference import masked_softmax
from .support import MuseTiles, check_tiles


@dataclass
class TiltPlan:
    cells: CellsPlan  # the exact part and the key cells
    centroids: torch.Tensor  # [B, Hq, Cq, D] in the input dtype: the tilt centres (rounded: used as they are)
    assign: torch.Tensor  # [B, Hq, Sp] int64: query cluster of each position (padding: 0, masked everywhere)
    order: torch.Tensor  # [B, Hq, Sp] int32: the positions sorted by (cluster, position), padding last


@torch.no_grad()
def cluster_queries(q: torch.Tensor, valid: torch.Tensor, C: int, iters: int, chunk_elems: int = 2**27,
                    triton: bool = False, tiles: MuseTiles | None = None):
    """Global Lloyd clustering of each head's queries. q [B, H, S, D], valid [B, S] bool -> centroids [B, H, C, D]
    float32 (the mean of the members; an empty cluster keeps its previous value), assign [B, H, S] int64 (invalid
    positions: 0). Initial centroids: C queries evenly spaced over each row's real positions (ties by position: the
    result is deterministic). Assignment: argmax of 2 x.c - |c|^2 (lowest cluster on ties), in float32; with `triton`
    (CUDA, bf16/fp16 queries: `triton_cluster.nearest_with_sums`, a round per launch) the products x.c come from the
    tensor cores (the centroids rounded to the queries' dtype, fp32 sums: near-ties may go the other way) and the
    members' sums from a one-hot product (its launch tiles: `tiles`, `support.MuseTiles`; None: the defaults). Means in
    float32."""
    B, H, S, D = q.shape
    dev = q.device
    nval = valid.sum(-1)  # [B]
    first_valid = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)  # real positions first, in order
    pick = (torch.arange(C, device=dev)[None] * nval[:, None].clamp_min(1)) // C  # [B, C]
    init = first_valid.gather(1, pick.clamp_max(S - 1))  # [B, C] positions
    cent = q.gather(2, init[:, None, :, None].expand(B, H, C, D)).float()

    def mean(s, cnt, cent):  # an empty cluster keeps its previous centroid
        return torch.where(cnt[..., None] > 0, s / cnt.clamp_min(1)[..., None], cent)

    if triton:  # on CUDA for bf16/fp16: a round in two kernels (the assignment, then the members' sums and counts)
        from .triton_cluster import nearest_with_sums

        for _ in range(iters + 1):
            a, s, cnt = nearest_with_sums(q, cent, valid, check_tiles(tiles))
            cent = mean(s, cnt, cent)
        return cent, a.masked_fill(~valid[:, None, :], 0)
    x = q.float()
    vf = valid[:, None, :].float()  # [B, 1, S]
    step = max(1, chunk_elems // max(1, B * H * C))  # positions per scoring chunk

    def assign_to(cent):
        a = torch.empty(B, H, S, dtype=torch.int64, device=dev)
        c2 = (cent * cent).sum(-1)[:, :, None, :]
        for s0 in range(0, S, step):
            a[:, :, s0:s0 + step] = (2 * x[:, :, s0:s0 + step] @ cent.transpose(-1, -2) - c2).argmax(-1)
        return a

    def update(a, cent):
        w = vf.expand(B, H, S)
        cnt = torch.zeros(B, H, C, device=dev).scatter_add_(2, a, w)
        s = torch.zeros(B, H, C, D, device=dev).scatter_add_(2, a[..., None].expand(B, H, S, D), x * w[..., None])
        return mean(s, cnt, cent)

    for _ in range(iters):
        cent = update(assign_to(cent), cent)
    a = assign_to(cent)
    cent = update(a, cent)
    return cent, a.masked_fill(~valid[:, None, :], 0)


@torch.no_grad()
def make_tilt_plan(q, k, *, scale: float, q_clusters: int = 256, kmeans_iters: int = 2, key_mask=None,
                   backend: str = "auto", tiles: MuseTiles | None = None, **cells_options) -> TiltPlan:
    """The cells plan (`make_cells_plan(q, k, **cells_options)`), the queries' global clusters and their sort.
    q [B, Hq, S, D], k [B, Hkv, S, D]; the centroids are rounded to q's dtype (the tilt point both paths use).
    `tiles`: the Triton clustering's launch tiles (`support.MuseTiles`; None: the defaults)."""
    B, Hq, S, D = q.shape
    cells = make_cells_plan(q, k, scale=scale, kmeans_iters=kmeans_iters, key_mask=key_mask, backend=backend,
                            **cells_options)
    Sp = cells.padded_len
    valid = cells.key_valid  # [B, Sp]
    qp = q if Sp == S else torch.nn.functional.pad(q, (0, 0, 0, Sp - S))  # (a zero pad would copy)
    use_triton = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
                  and resolve_backend(backend, q, what="muse plan") == "triton")
    # more clusters than queries: the evenly spaced initial centroids repeat queries, and a repeat never wins a
    # member (ties go to the lowest cluster), so the clusters are those of one per query; without the repeats,
    # whose centroids and summaries would be allocated for nothing (q_clusters=2**31-1 asked for 16 GiB at 20 tokens)
    q_clusters = min(q_clusters, Sp)
    cent, assign = cluster_queries(qp, valid, q_clusters, kmeans_iters, triton=use_triton, tiles=tiles)
    key = assign * Sp + torch.arange(Sp, device=q.device)
    key = torch.where(valid[:, None, :], key, q_clusters * Sp + torch.arange(Sp, device=q.device))  # padding last
    if (q_clusters + 1) * Sp < 2**31:  # 32-bit keys: half the radix sort's passes
        key = key.to(torch.int32)
    order = key.argsort(-1).to(torch.int32)
    return TiltPlan(cells, cent.to(q.dtype), assign, order)


def tilted_summaries(k, v, plan: TiltPlan, *, scale: float, chunk_elems: int = 2**26):
    """Every cell's summary tilted at every centroid of each query head, differentiable in k and v:
    lse [B, Hq, Cq, nb * Ck] (-inf: empty cell), kt, vt [B, Hq, Cq, nb * Ck, D], float32 (float64 for float64)."""
    cp = plan.cells
    B, Hkv, S, D = k.shape
    Hq, Cq = plan.centroids.shape[1], plan.centroids.shape[2]
    G = Hq // Hkv
    L, Ck, nb, Sp = cp.block_size, cp.k_clusters, cp.num_blocks, cp.padded_len
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    K = block_view(k.to(ct), L, Sp)  # [B, Hkv, nb, L, D]
    V = block_view(v.to(ct), L, Sp)
    C = plan.centroids.to(ct)
    cell = torch.nn.functional.one_hot(cp.k_assign.view(B, Hkv, nb, L), Ck).bool()  # [B, Hkv, nb, L, Ck]
    cell = cell & cp.key_valid.view(B, 1, nb, L, 1)
    lse = torch.empty(B, Hq, Cq, nb, Ck, dtype=ct, device=k.device)
    kt = torch.empty(B, Hq, Cq, nb, Ck, D, dtype=ct, device=k.device)
    vt = torch.empty_like(kt)
    step = max(1, chunk_elems // max(1, B * Cq * L * Ck))  # blocks per chunk
    for h in range(Hq):
        g = h // G
        for m0 in range(0, nb, step):
            m1 = min(nb, m0 + step)
            X = scale * torch.einsum("bid,bmld->biml", C[:, h], K[:, g, m0:m1])  # [B, Cq, m, L]
            Xc = X[..., None].masked_fill(~cell[:, g, None, m0:m1], -math.inf)  # [B, Cq, m, L, Ck]
            mx = Xc.amax(3, keepdim=True)
            mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
            e = torch.exp(Xc - mx)
            Z = e.sum(3)  # [B, Cq, m, Ck]
            Zs = torch.where(Z > 0, Z, torch.ones_like(Z))
            lse[:, h, :, m0:m1] = torch.where(Z > 0, Zs.log() + mx[:, :, :, 0], torch.full_like(Z, -math.inf))
            pi = e / Zs[:, :, :, None]
            kt[:, h, :, m0:m1] = torch.einsum("bimlc,bmld->bimcd", pi, K[:, g, m0:m1])
            vt[:, h, :, m0:m1] = torch.einsum("bimlc,bmld->bimcd", pi, V[:, g, m0:m1])
    return lse.flatten(3), kt.flatten(3, 4), vt.flatten(3, 4)


def tilted_cells_reference(q, k, v, plan: TiltPlan, *, scale: float, chunk_elems: int = 2**26) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D] (computed in float32, or float64 for float64)."""
    cp = plan.cells
    B, Hq, S, D = q.shape
    G = Hq // k.shape[1]
    L, Ck, nb, Sp = cp.block_size, cp.k_clusters, cp.num_blocks, cp.padded_len
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse, kt, vt = tilted_summaries(k, v, plan, scale=scale)
    C = plan.centroids.to(ct)
    Q = torch.nn.functional.pad(q.to(ct), (0, 0, 0, Sp - S))
    K = torch.nn.functional.pad(k.to(ct), (0, 0, 0, Sp - S)).repeat_interleave(G, 1)
    V = torch.nn.functional.pad(v.to(ct), (0, 0, 0, Sp - S)).repeat_interleave(G, 1)
    pos = torch.arange(Sp, device=q.device)
    step = max(1, chunk_elems // max(1, B * Hq * L * (Sp + nb * Ck * D)))
    outs = []
    for n0 in range(0, nb, step):
        n1 = min(nb, n0 + step)
        t = pos[n0 * L:n1 * L]
        exact, far = chunk_masks(cp, t)
        a = plan.assign[:, :, t]  # [B, Hq, T]
        gather = lambda x: torch.gather(x, 2, a[..., None].expand(*a.shape, x.shape[-1]))  # noqa: E731
        la = gather(lse)  # [B, Hq, T, nb*Ck]
        ka = torch.gather(kt, 2, a[..., None, None].expand(*a.shape, nb * Ck, D))  # [B, Hq, T, nb*Ck, D]
        va = torch.gather(vt, 2, a[..., None, None].expand(*a.shape, nb * Ck, D))
        d = Q[:, :, t] - gather(C)  # q - c
        sf = (la + scale * torch.einsum("bhtd,bhtcd->bhtc", d, ka)).masked_fill(~far | ~torch.isfinite(la), -math.inf)
        se = (scale * Q[:, :, t] @ K.transpose(-1, -2)).masked_fill(~exact, -math.inf)
        p = masked_softmax(torch.cat([se, sf], -1))
        outs.append(p[..., :Sp] @ V + torch.einsum("bhtc,bhtcd->bhtd", p[..., Sp:], va))
    out = torch.cat(outs, 2)[:, :, :S]
    return out.transpose(1, 2).to(q.dtype)
