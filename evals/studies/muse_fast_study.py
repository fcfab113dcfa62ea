"""Design study (dense float64, CPU): a MuSe far field whose cost is linear in the number of earlier blocks per query.

Every earlier block m is cut into `Ck` key cells by Lloyd iterations over its keys (as the package's MuSe does).
A query block n attends exactly to its own block (causally), to `local` blocks before it and to `topb` retrieved
earlier blocks; every other earlier block enters through its cells, each cell one super-key:

- `tilt="none"` (the multipole expansion of the cell around its mean key): logit `log n + tau q.mu`, value the
  mean value; `quad=True` adds the diagonal second-order term `tau^2/2 sum_d q_d^2 var_d`.
- `tilt="global"`: the package's tilted summary, at the centroid `c` of the query's *global* query cluster
  (`Cq` clusters per head over the whole sequence): logit `lse_c + tau (q - c).kt`, value `vt`. The summaries
  of a cell do not depend on the query block, so they are computed once per (cell, query cluster).

Retrieval: block m is scored for query block n by `score="mean"` (the monopole mass of m's cells at the block's
mean query) or `score="max"` (the largest monopole mass over the block's queries). Error: ||o - o_exact|| /
||o_exact|| per layer, over all heads.

    python -m evals.studies.muse_fast_study --seq-len 8192 --out evals/results/muse/fast-study-smollm2-135m-8k-cpu.json
"""

from __future__ import annotations

import math

import torch

from evals.studies.muse_farfield_study import layer_error as farfield_layer_error
from evals.studies.muse_farfield_study import run_study
from longctx_patch.kernels.muse.plan import lloyd

GRID = [
    dict(L=128, Ck=16, topb=4),
    dict(L=128, Ck=16, topb=8),
    dict(L=128, Ck=16, topb=8, quad=True),
    dict(L=128, Ck=32, topb=8),
    dict(L=128, Ck=16, topb=8, score="max"),
    dict(L=128, Ck=16, topb=8, tilt="global", Cq=16),
    dict(L=64, Ck=8, topb=16),
]


def cells(k, v, L, Ck, iters):
    """Per-block key cells of one head: mean key, mean value, count, per-dim key variance, member index."""
    S, D = k.shape
    nb = math.ceil(S / L)
    pad = nb * L - S
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(nb, L, D)
    valid = (torch.arange(nb * L) < S).view(nb, L)
    _, a, _ = lloyd(kb.float(), valid, Ck, iters)  # a: [nb, L] cell of each key
    oh = torch.nn.functional.one_hot(a.clamp_min(0), Ck).double() * valid[..., None]  # [nb, L, Ck]
    n = oh.sum(1)  # [nb, Ck]
    ns = n.clamp_min(1)[..., None]
    vb = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(nb, L, D)
    mu = torch.einsum("mlc,mld->mcd", oh, kb) / ns
    vbar = torch.einsum("mlc,mld->mcd", oh, vb) / ns
    var = torch.einsum("mlc,mld->mcd", oh, kb * kb) / ns - mu * mu
    return mu, vbar, n, var.clamp_min(0), oh, kb, vb


def fast_head(q, k, v, tau, *, L=128, Ck=16, topb=8, local=1, iters=2, quad=False, tilt="none", Cq=16,
              score="mean", qchunk=1024):
    S, D = q.shape
    nb = math.ceil(S / L)
    mu, vbar, n, var, oh, kb, vb = cells(k, v, L, Ck, iters)
    blk = torch.arange(S) // L
    ok_cell = n > 0  # [nb, Ck]
    logn = torch.log(n.clamp_min(1))
    # retrieval per query block
    ar = torch.arange(nb)
    far = ar[None, :] < (ar[:, None] - local)  # [n, m] candidate far blocks
    if score == "mean":
        qb = torch.nn.functional.pad(q, (0, 0, 0, nb * L - S)).view(nb, L, D)
        cnt = torch.bincount(blk, minlength=nb).double()
        qm = qb.sum(1) / cnt[:, None]
        mono = tau * torch.einsum("nd,mcd->nmc", qm, mu) + logn[None]
        bs = torch.logsumexp(mono.masked_fill(~ok_cell[None], -math.inf), -1)  # [n, m]
    else:
        bs = torch.full((nb, nb), -math.inf, dtype=q.dtype)
        for t0 in range(0, S, qchunk):
            t = torch.arange(t0, min(S, t0 + qchunk))
            mono = tau * torch.einsum("td,mcd->tmc", q[t], mu) + logn[None]
            per = torch.logsumexp(mono.masked_fill(~ok_cell[None], -math.inf), -1)  # [t, m]
            bs = bs.index_reduce(0, blk[t], per, "amax", include_self=True)
    R = torch.zeros(nb, nb, dtype=torch.bool)
    if topb > 0:
        sc = bs.masked_fill(~far, -math.inf)
        val, idx = sc.topk(min(topb, nb), -1)
        R.scatter_(-1, idx, torch.isfinite(val))
    summ = far & ~R  # [n, m] blocks summarised for query block n
    if tilt == "global":
        qc, qa, _ = lloyd(q[None].float(), torch.ones(1, S, dtype=torch.bool), Cq, iters)
        qc, qa = qc[0].double(), qa[0]
        # tilted summaries per (query cluster i, block m, cell c)
        X = tau * torch.einsum("id,mld->iml", qc, kb)  # [Cq, nb, L]
        X = X.masked_fill((torch.arange(nb * L) >= S).view(1, nb, L), -math.inf)
        W = torch.exp(X[..., None] + torch.log(oh)[None])  # [Cq, nb, L, Ck], log(0) = -inf
        Z = W.sum(2)  # [Cq, nb, Ck]
        Zs = Z.clamp_min(1e-300)
        kt = torch.einsum("imlc,mld->imcd", W, kb) / Zs[..., None]
        vt = torch.einsum("imlc,mld->imcd", W, vb) / Zs[..., None]
        lse = torch.log(Zs)
    out = torch.empty_like(v)
    for t0 in range(0, S, qchunk):
        t = torch.arange(t0, min(S, t0 + qchunk))
        nq = blk[t]
        exact = ((blk[None] == nq[:, None]) & (torch.arange(S)[None] <= t[:, None])) \
            | ((blk[None] < nq[:, None]) & (blk[None] >= nq[:, None] - local)) | R[nq][:, blk]
        el = (tau * q[t] @ k.T).masked_fill(~exact, -math.inf)
        use = summ[nq][:, :, None] & ok_cell[None]  # [t, m, c]
        if tilt == "global":
            i = qa[t]
            sl = lse[i] + tau * torch.einsum("td,tmcd->tmc", q[t] - qc[i], kt[i])
            val = vt[i]  # [t, m, c, D]
        else:
            sl = logn[None] + tau * torch.einsum("td,mcd->tmc", q[t], mu)
            if quad:
                sl = sl + 0.5 * tau * tau * torch.einsum("td,mcd->tmc", q[t] * q[t], var)
            val = vbar[None].expand(len(t), -1, -1, -1)
        sl = sl.masked_fill(~use, -math.inf).reshape(len(t), -1)
        p = torch.softmax(torch.cat([el, sl], -1), -1)
        out[t] = p[:, :S] @ v + torch.einsum("tx,txd->td", p[:, S:], val.reshape(len(t), -1, D))
    return out


def layer_error(q, k, v, tau, **cfg) -> float:
    if "perblock" in cfg:  # the package's MuSe (per-block query clusters), for comparison on the same data
        from longctx_patch.kernels.muse.plan import make_plan
        from longctx_patch.kernels.muse.reference import muse_reference_planned

        pcfg = dict(cfg["perblock"])
        untilted = pcfg.pop("untilted", False)
        plan = make_plan(q, k, scale=tau, **pcfg)
        if untilted:  # summaries at c = 0: the cell's mean key / mean value / log count, shared by every query
            plan.q_centroids = torch.zeros_like(plan.q_centroids)
        o = muse_reference_planned(q.double(), k.double(), v.double(), plan, scale=tau)
        r = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                              scale=tau, enable_gqa=True)
        return float((o.transpose(1, 2) - r).norm() / r.norm())
    return farfield_layer_error(q, k, v, tau, head=fast_head, **cfg)


def main():
    run_study(__doc__, "evals.studies.muse_fast_study", layer_error, GRID, seq_len=8192, layers="0,7,15,23",
              kind="fast-study", defaults=dict(local=1, iters=2, tilt="none", score="mean"))


if __name__ == "__main__":
    main()
