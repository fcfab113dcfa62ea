"""Pure-PyTorch reference of causal MuSe attention (differentiable, any device, dense: small S only).

See docs/muse.md for the derivation. Given a `MusePlan` (clusters + retrieval, no gradient), the output of
query t (block n, query cluster i = q_assign[t], centroid c = q_centroids[n, i], d = q_t - c) is a softmax
over three kinds of keys, with one normaliser:

* exact keys: every real key of its own block at or before t, and every real key of the blocks / cells the
  plan retrieved for (n, i); logit `scale * q_t . k_s`, value `v_s`;
* super-keys: every other non-empty cell (m, j), m < n (key cluster j of block m), summarised with weights
  w_s = exp(scale * c . k_s) over its real keys:
  `lse = log sum w_s`, `kt = sum w_s k_s / sum w_s`, `vt = sum w_s v_s / sum w_s`;
  logit `lse + scale * d . kt`, value `vt` (plus `scale * d^T Cov` with the dipole,
  `Cov = sum w_s (k_s - kt) v_s^T / sum w_s`).

Gradients flow through q, k and v (exact logits, the summaries' lse/kt/vt); centroids and assignments
are constants.
"""

from __future__ import annotations

import math

import torch

from .plan import MusePlan, block_view


def masked_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where -inf marks masked entries; a row with no entry gives zeros (not NaN)."""
    rmax = logits.amax(-1, keepdim=True)
    rmax = torch.where(torch.isfinite(rmax), rmax, torch.zeros_like(rmax)).detach()
    p = torch.exp(logits - rmax)
    den = p.sum(-1, keepdim=True)
    return p / torch.where(den > 0, den, torch.ones_like(den))


def _chunk(Q, K, V, ka, kval, plan: MusePlan, n0: int, n1: int, *, scale: float, dipole: bool, ct) -> torch.Tensor:
    """Output [B, H, n1 - n0, L, D] of query blocks n0..n1-1 (K, V, ka expanded to the query heads)."""
    B, Hq, nb, L, D = K.shape
    dev = K.device
    ninf = -math.inf
    Q = Q[:, :, n0:n1]
    Cq = plan.q_centroids[:, :, n0:n1].to(ct)  # [B, H, n, i, D], constant
    nq = Cq.shape[3]
    qa = plan.q_assign.long().reshape(B, Hq, nb, L)[:, :, n0:n1]
    nk = plan.ret_cell.shape[-1]
    RB, RC = plan.ret_block[:, :, n0:n1], plan.ret_cell[:, :, n0:n1]  # [B,H,n,i,m], [B,H,n,i,m,j]
    ar = torch.arange(nb, device=dev)
    ns = torch.arange(n0, n1, device=dev)
    nn = n1 - n0
    earlier = ar[None, :] < ns[:, None]  # [n, m]

    # ---- summaries of cell (m, j) for query cluster (n, i)
    X = scale * torch.einsum("bhnid,bhmld->bhniml", Cq, K)  # [B,H,n,i,m,l]
    ohk = torch.nn.functional.one_hot(ka, nk).bool()  # [B,H,m,l,j]
    allowed = (
        earlier[None, None, :, None, :, None, None]
        & kval[:, :, None, None, :, None, :]  # [B,1,1,1,m,1,l]
        & ohk.permute(0, 1, 2, 4, 3)[:, :, None, None]  # [B,H,1,1,m,j,l]
        & ~RB[..., None, None]
        & ~RC[..., None]
    )  # [B,H,n,i,m,j,l]
    Xc = X[:, :, :, :, :, None, :].expand(allowed.shape).masked_fill(~allowed, ninf)
    mx = Xc.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(Xc - mx)
    Z = e.sum(-1)  # [B,H,n,i,m,j]
    nonempty = Z > 0
    Zs = torch.where(nonempty, Z, torch.ones_like(Z))
    pi = e / Zs[..., None]
    lse = torch.log(Zs) + mx[..., 0]
    Kt = torch.einsum("bhnimjl,bhmld->bhnimjd", pi, K)
    Vt = torch.einsum("bhnimjl,bhmld->bhnimjd", pi, V)

    # ---- exact part: own block causal + retrieved blocks/cells
    qa_oh = torch.nn.functional.one_hot(qa, nq).to(ct)  # [B,H,n,t,i]
    qa_ohb = qa_oh.bool()
    rbq = (qa_ohb[..., None] & RB[:, :, :, None]).any(-2)  # [B,H,n,t,m]
    rcq_cells = (qa_ohb[..., None, None] & RC[:, :, :, None]).any(-3)  # [B,H,n,t,m,j]
    rcq = torch.gather(rcq_cells, -1, ka[:, :, None, None].expand(B, Hq, nn, L, nb, L))  # [B,H,n,t,m,l]
    tri = torch.arange(L, device=dev)
    diag = (ns[:, None] == ar[None, :])[:, None, :, None] & (tri[None, :, None, None] >= tri[None, None, None, :])
    emask = (diag[None, None] | rbq[..., None] | rcq) & kval[:, :, None, None]  # [B,H,n,t,m,l]
    se = scale * torch.einsum("bhntd,bhmld->bhntml", Q, K).masked_fill(~emask, ninf)

    # ---- super-key part
    dq = Q - torch.einsum("bhnti,bhnid->bhntd", qa_oh, Cq)  # q - c
    sup = lse - scale * (Cq[:, :, :, :, None, None, :] * Kt).sum(-1)  # [B,H,n,i,m,j]
    ys = torch.einsum("bhntd,bhnimjd->bhntimj", Q, Kt) * scale + sup[:, :, :, None]
    smask = nonempty & ~RB[..., None] & ~RC & earlier[None, None, :, None, :, None]  # [B,H,n,i,m,j]
    smask_t = smask[:, :, :, None] & qa_ohb[..., None, None]  # [B,H,n,t,i,m,j]
    ys = ys.masked_fill(~smask_t, ninf)

    # ---- one softmax over both
    se_f = se.flatten(-2)  # [B,H,n,t,m*l]
    ys_f = ys.flatten(-3)  # [B,H,n,t,i*m*j]
    p = masked_softmax(torch.cat([se_f, ys_f], -1))
    pe = p[..., : se_f.shape[-1]].reshape(se.shape)
    ps = p[..., se_f.shape[-1] :].reshape(ys.shape)
    out = torch.einsum("bhntml,bhmld->bhntd", pe, V) + torch.einsum("bhntimj,bhnimjd->bhntd", ps, Vt)
    if dipole:
        kd = K[:, :, None, None, :, None] - Kt[..., None, :]  # [B,H,n,i,m,j,l,D]
        cov = torch.einsum("bhnimjl,bhnimjlD,bhmle->bhnimjDe", pi, kd, V)
        out = out + scale * torch.einsum("bhntimj,bhntD,bhnimjDe->bhnte", ps, dq, cov)
    return out


def muse_reference_planned(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: MusePlan,
    *,
    scale: float,
    dipole: bool = False,
    chunk_elems: int = 2**26,
) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> o [B, S, Hq, D] in q's dtype (computed in float32 or float64).

    Query blocks are processed in chunks so that the largest dense intermediate holds about `chunk_elems`
    elements (memory O(S * chunk) instead of O(S^2)); the result does not depend on the chunking.
    """
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    L, nb, Sp = plan.block_size, plan.num_blocks, plan.padded_len
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    Q = block_view(q.to(ct), L, Sp)  # [B, H, n, L, D]
    K = block_view(k.to(ct), L, Sp).repeat_interleave(G, dim=1)
    V = block_view(v.to(ct), L, Sp).repeat_interleave(G, dim=1)
    nk = plan.ret_cell.shape[-1]
    nq = plan.q_centroids.shape[3]
    ka = plan.k_assign.long().repeat_interleave(G, dim=1).reshape(B, Hq, nb, L)
    kval = plan.key_valid.reshape(B, 1, nb, L)
    per_block = B * Hq * Sp * max(L, nq * nk) * (D if dipole else 1)  # largest intermediate per query block
    step = max(1, chunk_elems // max(1, per_block))
    outs = [
        _chunk(Q, K, V, ka, kval, plan, n0, min(nb, n0 + step), scale=scale, dipole=dipole, ct=ct)
        for n0 in range(0, nb, step)
    ]
    out = torch.cat(outs, 2)  # [B, H, n, L, D]
    out = out.reshape(B, Hq, Sp, D)[:, :, :S]
    return out.transpose(1, 2).to(q.dtype)
