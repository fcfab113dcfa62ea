"""Where does MuSe's long-context error come from? An anatomy of the cells plan on SmolLM2-135M's real Q/K/V.

For each layer, against exact attention (the relative error of the output, as in muse_fidelity.py):
- `mass_far`: the share of the exact attention that falls on keys the plan leaves to the cells (mean over queries
  and heads), overall and per head;
- the error of the plan's far field as the package computes it (`mono`: a cell is one super-key, its mean key and
  mean value, weight `n exp(s q.mu)`), per head and per query-position bucket;
- the same plan with other far-field models, to split the error between the cells' weights and their values:
  `iso` / `diag` add the Gaussian second-order term of the cell's keys to the logit (`s^2 |q|^2 var / 2` with one
  variance per cell, or `s^2 sum_d q_d^2 var_d / 2` with one per dimension); `wexact` gives each cell its exact
  weight `sum_j exp(s q.k_j)` with the mean value (what no summary of the weights can beat);
- other retrievals of as many exact blocks per query block, with the `mono` far field: `oracle` picks the blocks of
  most exact attention mass of the block's queries (what no retrieval score can beat); `score_keys` scores block m
  at the block's mean query with every key (`logsumexp_j s qbar.k_j`) instead of the cell means (the package),
  `score_keys_max` with its best key (`max_j`), `score_keys_max_q4` the same at 4 query sub-centroids of the block
  (Lloyd), the best of the 4, `score_keys_top4` with its 4 best keys, `score_cells_iso` with the cell
  means plus the Gaussian variance term; and two that use every query of the block, as the oracle does:
  `score_pair_max` (the best query-key logit of the two blocks) and `score_query_max_mean` (each query's best key
  in block m, averaged over the block's queries).
Dense per query block (B = 1): a CUDA GPU for 64k, the CPU for a few thousand tokens.

    python3 -m evals.studies.muse_error_anatomy --device cuda --model /tmp/smollm2.gguf --data .device-data \
        --seq-len 65536 --layers 18,29,8,5 --out $OUT/muse/error-anatomy-smollm2-135m-64k-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time

import torch

from evals.shared import SHARED_DATA, device_token, model_token, result_file
from longctx_patch.kernels.muse.reference_cells import take_top
from evals.studies.muse_fidelity import real_qkv
from longctx_patch.evals.common import git_commit, size_label
from longctx_patch.kernels.muse.reference_cells import cell_summaries, cells_reference, make_cells_plan
from longctx_patch.kernels.muse.ops import cells_triton
from longctx_patch.kernels.muse.plan import lloyd, log_counts
from longctx_patch.methods.muse import FAR_FIELD_DEFAULTS

FAR_MODELS = ("mono", "iso", "diag", "wexact")


def cell_stats(k, plan):
    """Per cell: mean key, per-dimension variance of its keys, [B, Hkv, nb, Ck, D] each (float32)."""
    mu, m2 = cell_summaries(k, k * k, plan)  # the "values" k^2: their cell means are E[k^2]
    return mu, (m2 - mu * mu).clamp_min(0)


def _exact_mask(plan, n, L, dev):
    """[Hq, L, Sp] keys attended exactly by the queries of block n (own block causal, local, retrieved)."""
    Sp, loc = plan.padded_len, plan.local_blocks
    pos = torch.arange(Sp, device=dev)
    t = torch.arange(n * L, (n + 1) * L, device=dev)
    kblk = pos // L
    base = ((kblk[None] == n) & (pos[None] <= t[:, None])) | ((kblk[None] < n) & (kblk[None] >= n - loc))
    ret = plan.retrieved[0, :, n][:, kblk]  # [Hq, Sp]
    return (base[None] | ret[:, None, :]) & plan.key_valid[0][None, None, :]


def _retrievals(Q, K, mu, var, logn, valid, mass, pair_max, qmax_mean, scale, retrieval, Hq, nb, L, Ck, D):
    """The other retrievals of as many blocks (module docstring): name -> plan."""
    vb = valid.view(nb, L)
    qbar = (Q.view(Hq, nb, L, D) * vb[None, :, :, None]).sum(2) / vb.sum(1).clamp_min(1)[None, :, None]
    sk = (scale * qbar @ K.transpose(1, 2)).masked_fill(~valid[None, None], float("-inf")).view(Hq, nb, nb, L)
    # 4 query sub-centroids per query block (Lloyd on its queries): the peak score at each, the best one kept
    cq = lloyd(Q.reshape(Hq * nb, L, D), vb.repeat(Hq, 1), 4, 2, backend="torch")[0].view(Hq, nb, 4, D)
    sq = torch.einsum("hnad,hsd->hnas", scale * cq, K).masked_fill(~valid[None, None, None], float("-inf"))
    peak_q4 = sq.view(Hq, nb, 4, nb, L).amax(-1).amax(2)
    del sq
    mu_b = mu.view(Hq, nb, Ck, D)
    iso = (scale * torch.einsum("hnd,hmcd->hnmc", qbar, mu_b) + logn.view(Hq, 1, nb, Ck)
           + 0.5 * scale**2 * (qbar * qbar).sum(-1)[:, :, None, None] * var.mean(-1).view(Hq, 1, nb, Ck))
    plans = {"oracle": retrieval(mass),
             "score_keys": retrieval(torch.logsumexp(sk, -1)),  # sum_j exp(s qbar.k_j) over the block's keys
             "score_keys_max": retrieval(sk.amax(-1)),  # the block's best key at the mean query
             "score_keys_top4": retrieval(torch.logsumexp(sk.topk(4, -1).values, -1)),  # its 4 best keys
             "score_keys_max_q4": retrieval(peak_q4),  # the best key at the best of 4 query sub-centroids
             "score_pair_max": retrieval(pair_max),  # the best (query, key) pair of the two blocks
             "score_query_max_mean": retrieval(qmax_mean),  # each query's best key, averaged over the queries
             "score_cells_iso": retrieval(torch.logsumexp(iso, -1))}  # cells with the Gaussian variance term
    return plans


def anatomy(q, k, v, scale: float, cfg: dict, buckets: int = 8, far_only: bool = False) -> dict:
    """q [1, Hq, S, D], k/v [1, Hkv, S, D] float32 -> the layer's measures (see the module docstring); far_only:
    the far-field models on the plan only, without the other retrievals."""
    _, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    dev = q.device
    plan = make_cells_plan(q, k, scale=scale, **cfg)
    L, Ck, nb, Sp, loc = plan.block_size, plan.k_clusters, plan.num_blocks, plan.padded_len, plan.local_blocks
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, Sp - S))[0].repeat_interleave(G, 0)  # noqa: E731
    Q = torch.nn.functional.pad(q, (0, 0, 0, Sp - S))[0]  # [Hq, Sp, D]
    K, V = pad(k), pad(v)
    mu, var = cell_stats(k, plan)
    vbar = cell_summaries(k, v, plan)[1]
    rep = lambda t: t[0].repeat_interleave(G, 0).flatten(1, 2)  # noqa: E731  [Hq, nb*Ck, ...]
    mu, var, vbar = rep(mu), rep(var), rep(vbar)
    logn = log_counts(plan.counts)[0].repeat_interleave(G, 0).flatten(1)  # [Hq, nb*Ck]
    cell_of_key = (torch.arange(Sp, device=dev) // L * Ck)[None] + plan.k_assign[0].repeat_interleave(G, 0)
    cblk = torch.arange(nb * Ck, device=dev) // Ck
    valid = plan.key_valid[0]

    # pass 1: exact attention, its mass per (query block, key block), the plan's exact share
    o_ex = torch.zeros(Hq, Sp, D, device=dev)
    mass = torch.zeros(Hq, nb, nb, device=dev)
    pair_max = torch.full((Hq, nb, nb), float("-inf"), device=dev)  # best (query, key) logit per block pair
    qmax_mean = torch.zeros(Hq, nb, nb, device=dev)  # mean over the block's queries of their best key's logit
    covered = torch.zeros(Hq, Sp, device=dev)
    pos = torch.arange(Sp, device=dev)
    for n in range(nb):
        t = pos[n * L:(n + 1) * L]
        s = scale * Q[:, t] @ K.transpose(1, 2)  # [Hq, L, Sp]
        causal = (pos[None] <= t[:, None]) & valid[None]
        p = torch.softmax(s.masked_fill(~causal[None], float("-inf")), -1)
        o_ex[:, t] = p @ V
        mass[:, n] = p.view(Hq, L, nb, L).sum((1, 3))
        sb = s.masked_fill(~valid[None, None], float("-inf")).view(Hq, L, nb, L).amax(-1)  # [Hq, L, nb]
        pair_max[:, n] = sb.amax(1)
        qmax_mean[:, n] = sb.mean(1)
        covered[:, t] = (p * _exact_mask(plan, n, L, dev)).sum(-1)
    # other retrievals of the same size: the plan's sinks, then the far non-sink blocks of best score, the score
    # being the exact attention mass of the block's queries (oracle) or an estimate of it at the mean query
    ar = torch.arange(nb, device=dev)
    far = ar[None, :] < ar[:, None] - loc
    first = int(valid.view(nb, L).any(-1).to(torch.int8).argmax())
    sink = ((ar >= first) & (ar < first + cfg.get("sink_blocks", 1)))[None, None, :] & far[None]
    kk = min(cfg["topk_blocks"] + cfg.get("peak_blocks", 0), nb)

    def retrieval(score):  # [Hq, nb, nb] -> the plan with these retrieved blocks
        R = sink.expand(Hq, nb, nb).clone()
        take_top(R, score.masked_fill(~far[None] | sink, float("-inf")), kk)
        return dataclasses.replace(plan, retrieved=R[None])

    plans = {} if far_only else _retrievals(Q, K, mu, var, logn, valid, mass, pair_max, qmax_mean, scale, retrieval,
                                           Hq, nb, L, Ck, D)

    # pass 2: the far-field models on the plan, and the plan's own model on the other retrievals

    outs = {m: torch.zeros(Hq, Sp, D, device=dev) for m in (*FAR_MODELS, *plans)}
    for n in range(nb):
        t = pos[n * L:(n + 1) * L]
        qt = Q[:, t]
        s = scale * qt @ K.transpose(1, 2)
        qmu = scale * qt @ mu.transpose(1, 2)  # [Hq, L, nb*Ck]
        for name, pl in (("plan", plan), *plans.items()):
            ex = _exact_mask(pl, n, L, dev)
            se = s.masked_fill(~ex, float("-inf"))
            summ = (cblk[None] < n - loc)[None] & ~pl.retrieved[0, :, n][:, cblk][:, None, :] \
                & (logn > float("-inf"))[:, None, :]  # [Hq, 1|L, nb*Ck]
            models = FAR_MODELS if name == "plan" else ("mono",)
            for m in models:
                if m == "mono":
                    a = qmu + logn[:, None]
                elif m == "iso":
                    a = qmu + logn[:, None] + 0.5 * scale**2 * (qt * qt).sum(-1, keepdim=True) * var.mean(-1)[:, None]
                elif m == "diag":
                    a = qmu + logn[:, None] + 0.5 * scale**2 * (qt * qt) @ var.transpose(1, 2)
                else:  # wexact: log sum_j exp(s_j) per cell, over the far keys of the cell
                    far_keys = valid[None, None] & ~ex & (torch.arange(Sp, device=dev) // L < n - loc)[None, None]
                    mx = s.amax(-1, keepdim=True)
                    w = torch.exp(s - mx) * far_keys
                    a = torch.zeros(Hq, L, nb * Ck, device=dev).scatter_add_(
                        -1, cell_of_key[:, None, :].expand(Hq, L, Sp), w).log() + mx
                a = a.masked_fill(~summ, float("-inf"))
                p = torch.softmax(torch.cat([se, a], -1), -1)
                o = p[..., :Sp] @ V + p[..., Sp:] @ vbar
                outs[m if name == "plan" else name][:, t] = o

    def err(o, rows=slice(0, S), heads=slice(None)):
        d = (o[heads, rows] - o_ex[heads, rows]).double()
        return float(d.norm() / o_ex[heads, rows].double().norm())

    # self-check: the `mono` model on the plan is the package's cells attention
    pkg = (cells_triton if q.is_cuda else cells_reference)(q, k, v, plan, scale=scale)[0].transpose(0, 1)
    mono_vs_package = float((outs["mono"][:, :S] - pkg).norm() / pkg.norm())
    edges = [round(S * i / buckets) for i in range(buckets + 1)]
    real = valid[:S]
    far_mass = (1 - covered[:, :S][:, real])
    return dict(
        config=cfg, mono_vs_package=mono_vs_package,
        mass_far=float(far_mass.mean()), mass_far_per_head=far_mass.mean(1).tolist(),
        err={m: err(o) for m, o in outs.items()},
        err_mono_per_head=[err(outs["mono"], heads=slice(h, h + 1)) for h in range(Hq)],
        err_oracle_per_head=[err(outs["oracle"], heads=slice(h, h + 1)) for h in range(Hq)] if plans else None,
        bucket_edges=edges,
        err_mono_by_position=[err(outs["mono"], rows=slice(a, b)) for a, b in zip(edges[:-1], edges[1:])],
        mass_far_by_position=[float(1 - covered[:, a:b].mean()) for a, b in zip(edges[:-1], edges[1:])],
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--layers", default="18,29,8,5")
    ap.add_argument("--data", default=str(SHARED_DATA))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", default="{}", help="cells plan options as JSON over the package's cells defaults")
    ap.add_argument("--out", default=None, help="file (default evals/results/muse/error-anatomy-<model>-<seq>-<device>.json)")
    ap.add_argument("--far-only", action="store_true", help="only the far-field models on the package's plan")
    args = ap.parse_args()
    out = result_file("muse", f"error-anatomy-{model_token(args.model)}-{size_label(args.seq_len)}"
                      f"{'-far' if args.far_only else ''}-{device_token(args.device)}.json", args.out)
    cfg = {**FAR_FIELD_DEFAULTS["cells"], "sink_blocks": 1, **json.loads(args.config)}
    qkv, scale = real_qkv(args.model, args.data, args.seq_len, args.device)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    res = dict(device=device, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=git_commit(),
               command="python3 -m evals.studies.muse_error_anatomy " + " ".join(sys.argv[1:]),
               model=args.model, seq_len=args.seq_len, text="pg_essays", metric="||o - o_exact|| / ||o_exact||",
               layers={})
    for i in (int(x) for x in args.layers.split(",")):
        t0 = time.time()
        q, k, v = qkv[i]
        with torch.no_grad():
            row = anatomy(q, k, v, scale, cfg, far_only=args.far_only)
        res["layers"][str(i)] = row
        print(f"layer {i}: far mass {row['mass_far']:.3f} " + " ".join(f"{m} {e:.4f}" for m, e in row["err"].items())
              + f" ({time.time() - t0:.0f}s)", flush=True)
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
