"""Does the tilt pay when query clusters are shared by many query blocks? The far field of the cells plan, three ways.

The tilted design's summaries are specific to one query cluster of one block, so every (query block, key block) pair
pays for its own (docs/muse.md, section 6). Clustering the queries over a *span* of `q_span` blocks instead (one set
of `q_clusters` centroids per span and query head) lets every query block of the span share them: the far field's
cost falls by the span. This study measures, on real Q/K/V, what that costs in accuracy. The exact part is the cells
plan's (own block, local, sink, retrieved blocks per query block); only the far field changes:

- `cells`: each key cell (m, c) one super-key, its mean key and mean value, logit `log n + s q.mu` (the package);
- `tilt span=P q=C`: the queries of every span of P blocks clustered (Lloyd, C clusters per query head); query t of
  cluster i (centroid c) sees cell (m, c') through its summary tilted at c: `w_j = exp(s c.k_j)`, `lse = log sum w`,
  `kt = sum w k / sum w`, `vt = sum w v / sum w`, logit `lse + s (q_t - c).kt`, value `vt` (docs/muse.md section 1);
- `wexact`: each far cell with its exact weight `sum_j exp(s q.k_j)` and its mean value (no weight model beats it).

Relative error of the output against exact attention, per layer (B = 1, float32, dense per head: a few 10k tokens).

    python -m evals.studies.muse_tilt_study --model qwen2.5-coder-0.5b --seq-len 16384 --layers 11,3 \\
        --out evals/results/muse/tilt-span-qwen2.5-coder-0.5b-16k-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time

import torch

from evals.shared import SHARED_DATA, device_token, model_token, result_file
from evals.studies.muse_fidelity import real_qkv
from longctx_patch.evals.common import git_commit, size_label
from longctx_patch.kernels.muse.reference_cells import cell_summaries, make_cells_plan
from longctx_patch.kernels.muse.plan import lloyd, log_counts

NINF = -math.inf


def _merge(parts):
    """Combines partial softmaxes [(max [T], sum [T], unnormalised output [T, D])] into the output [T, D]."""
    m = torch.stack([p[0] for p in parts]).amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    num = sum(p[2] * torch.exp(p[0] - m)[:, None] for p in parts)
    den = sum(p[1] * torch.exp(p[0] - m) for p in parts)
    return num / den.clamp_min(1e-30)[:, None]


def _partial(logits, vals):
    """(max, sum, unnormalised output) of a masked (-inf) logit matrix [T, N] against values [T or 1, N, D] / [N, D]."""
    m = logits.amax(-1)
    mm = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - mm[:, None])
    o = p @ vals if vals.dim() == 2 else torch.einsum("tn,tnd->td", p, vals)
    return m, p.sum(-1), o


def span_summaries(C, K, V, cell, ncell, valid, scale):
    """Summaries of every key cell tilted at every centroid. C [Cq, D], K/V [Sp, D], cell [Sp] (global cell id),
    valid [Sp] -> lse [Cq, ncell] (-inf: empty), kt, vt [Cq, ncell, D]."""
    X = (scale * C @ K.T).masked_fill(~valid[None], NINF)  # [Cq, Sp]
    idx = cell[None].expand_as(X)
    mx = torch.full((C.shape[0], ncell), NINF).scatter_reduce(1, idx, X, "amax")
    mxs = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(X - mxs.gather(1, idx))  # [Cq, Sp], 0 at invalid keys
    Z = torch.zeros_like(mx).scatter_add(1, idx, e)
    kt = torch.zeros(C.shape[0], ncell, K.shape[1]).index_add_(1, cell, e[:, :, None] * K[None])
    vt = torch.zeros_like(kt).index_add_(1, cell, e[:, :, None] * V[None])
    Zs = Z.clamp_min(1e-30)[:, :, None]
    return torch.where(Z > 0, Z.clamp_min(1e-30).log() + mxs, torch.full_like(Z, NINF)), kt / Zs, vt / Zs


def layer_errors(q, k, v, scale, cells_cfg, tilts, chunk=1024):
    """q [1, Hq, S, D], k/v [1, Hkv, S, D] float32 -> {name: relative error} for cells, wexact and every tilt."""
    _, Hq, S, D = q.shape
    G = Hq // k.shape[1]
    plan = make_cells_plan(q, k, scale=scale, backend="torch", **cells_cfg)
    L, Ck, nb, Sp, loc = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len, plan.local_blocks
    ncell = nb * Ck
    mu, vbar = cell_summaries(k, v, plan)
    logn = log_counts(plan.counts)[0].flatten(1)  # [Hkv, ncell]
    pad = lambda t: torch.nn.functional.pad(t[0], (0, 0, 0, Sp - S))  # noqa: E731
    Q, K, V = pad(q), pad(k), pad(v)
    pos = torch.arange(Sp)
    kblk = pos // L
    cblk = torch.arange(ncell) // Ck
    valid = plan.key_valid[0]
    num = {n: 0.0 for n in ["cells", "wexact"] + [t["name"] for t in tilts]}
    den = 0.0
    for h in range(Hq):
        g = h // G
        Kh, Vh = K[g], V[g]
        cell = kblk * Ck + plan.k_assign[0, g]
        # the tilt's query clusters and summaries, per span of every configuration
        tilt_parts = {}
        for t in tilts:
            span = t["q_span"] * L
            ns = math.ceil(Sp / span)
            Qs = torch.nn.functional.pad(Q[h], (0, 0, 0, ns * span - Sp)).view(ns, span, D)
            vq = torch.nn.functional.pad(valid, (0, ns * span - Sp)).view(ns, span)
            cent, assign, _ = lloyd(Qs, vq, t["q_clusters"], 2, backend="torch")
            if t.get("group"):  # balanced: sort by cluster (then position), cut into groups of `group` queries
                order = (assign * span + torch.arange(span)[None]).argsort(-1)
                assign = torch.empty_like(assign).scatter_(1, order, (torch.arange(span) // t["group"])[None].expand_as(order))
                oh = torch.nn.functional.one_hot(assign, span // t["group"]).float() * vq[..., None]
                cent = torch.einsum("nsg,nsd->ngd", oh, Qs) / oh.sum(1).clamp_min(1)[..., None]
            tilt_parts[t["name"]] = (span, cent, assign.view(-1)[:Sp])
        summ = {}  # (config, span) -> its tilted summaries (this head)
        for n0 in range(0, Sp, chunk):
            t_ = pos[n0:n0 + chunk]
            n = t_ // L
            s = scale * Q[h, t_] @ Kh.T  # [T, Sp]
            exact = ((kblk[None] == n[:, None]) & (pos[None] <= t_[:, None])) \
                | ((kblk[None] < n[:, None]) & (kblk[None] >= n[:, None] - loc))
            R = plan.retrieved[0, h][n]  # [T, nb]
            exact = (exact | R[:, kblk]) & valid[None]
            far = (cblk[None] < n[:, None] - loc) & ~R[:, cblk]  # [T, ncell]
            ref = torch.softmax(s.masked_fill(~valid[None] | (pos[None] > t_[:, None]), NINF), -1) @ Vh
            pe = _partial(s.masked_fill(~exact, NINF), Vh)
            sc = (scale * Q[h, t_] @ mu[0, g].flatten(0, 1).T + logn[g][None]).masked_fill(~far, NINF)
            outs = {"cells": _merge([pe, _partial(sc, vbar[0, g].flatten(0, 1))])}
            # wexact: each far cell's exact log-weight logsumexp_j s q.k_j over its keys
            sv = s.masked_fill(~valid[None], NINF)
            mx = torch.full((len(t_), ncell), NINF).scatter_reduce(1, cell[None].expand_as(sv), sv, "amax")
            mxs = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
            w = torch.zeros_like(mx).scatter_add(1, cell[None].expand_as(sv), torch.exp(sv - mxs.gather(1, cell[None].expand_as(sv))))
            lw = torch.where(w > 0, w.clamp_min(1e-30).log() + mxs, torch.full_like(w, NINF)).masked_fill(~far, NINF)
            outs["wexact"] = _merge([pe, _partial(lw, vbar[0, g].flatten(0, 1))])
            for t in tilts:
                span, cent, assign = tilt_parts[t["name"]]
                a = assign[t_]
                span_ix = t_ // span
                sids = span_ix.unique().tolist()  # the spans this chunk touches; their summaries once per head
                for si in sids:
                    if (t["name"], si) not in summ:
                        summ[(t["name"], si)] = span_summaries(cent[si], Kh, Vh, cell, ncell, valid, scale)
                loc_ix = span_ix - sids[0]
                lse, kt, vt = (torch.stack([summ[(t["name"], si)][j] for si in sids])[loc_ix, a] for j in range(3))
                c = cent[span_ix, a]
                lg = (lse + scale * torch.einsum("td,tnd->tn", Q[h, t_] - c, kt)).masked_fill(~far, NINF)
                outs[t["name"]] = _merge([pe, _partial(lg, vt)])
            real = t_ < S
            for name, o in outs.items():
                num[name] += ((o - ref)[real] ** 2).sum().item()
            den += (ref[real] ** 2).sum().item()
    return {name: math.sqrt(x / den) for name, x in num.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--layers", default="11,3")
    ap.add_argument("--data", default=str(SHARED_DATA))
    ap.add_argument("--cells", default='{"block_size": 256, "k_clusters": 8, "topk_blocks": 7, "peak_blocks": 7}',
                    help="the cells plan (JSON): the exact part of every row")
    ap.add_argument("--tilts", default="[[1, 16], [4, 16], [4, 64], [16, 64], [64, 64]]",
                    help="JSON list of [q_span blocks, q_clusters] or [q_span, q_clusters, group]: the span's queries sorted "
                         "by cluster and cut into balanced groups of `group` queries, each tilted at its mean")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = result_file("muse", f"tilt-span-{model_token(args.model)}-{size_label(args.seq_len)}-{device_token('cpu')}.json",
                      args.out)
    torch.manual_seed(0)
    qkv, scale = real_qkv(args.model, args.data, args.seq_len, "cpu")
    cells_cfg = json.loads(args.cells)
    tilts = [dict(name=f"tilt span={t[0]} q={t[1]}" + (f" groups of {t[2]}" if len(t) > 2 else ""), q_span=t[0],
                  q_clusters=t[1], group=t[2] if len(t) > 2 else 0) for t in json.loads(args.tilts)]
    per_layer = {}
    for i in [int(x) for x in args.layers.split(",")]:
        t0 = time.time()
        per_layer[i] = layer_errors(*qkv[i], scale, cells_cfg, tilts)
        print(f"layer {i} ({time.time() - t0:.0f}s): " + ", ".join(f"{k} {v:.4f}" for k, v in per_layer[i].items()),
              flush=True)
    names = list(next(iter(per_layer.values())))
    rows = [dict(far_field=n, mean_rel_err=sum(per_layer[i][n] for i in per_layer) / len(per_layer),
                 per_layer={str(i): per_layer[i][n] for i in per_layer}) for n in names]
    res = dict(device="cpu", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=git_commit(), command="python -m evals.studies.muse_tilt_study " + " ".join(
                   f"--{k.replace('_', '-')} '{v}'" for k, v in vars(args).items() if v is not None),
               model=args.model, seq_len=args.seq_len, cells_plan=cells_cfg, metric="||o - o_exact|| / ||o_exact||",
               results=rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
