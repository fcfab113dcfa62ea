"""Design study (not a product path): a linear-cost MuSe far field, measured on real SmolLM2 Q/K/V.

The package's MuSe tilts every summary at the centroid of a query cluster *of one block*, so summaries cannot
be shared between query blocks and the far field costs O((S/L)^2) block pairs (docs/muse.md, section 6). This
study measures the obvious linear-cost alternative: query and key clusters *global* per head (Lloyd over the
whole sequence), so that the tilted summary of (query cluster i, key cluster j) over all keys before block
n - local is a prefix sum over blocks, computable in one pass. Everything else is kept: exact own block,
`local` exact blocks, `topb` retrieved blocks per (query block, query cluster), scored by their exact tilted
mass and removed from the summaries. `nosum` drops the summaries (block-sparse attention only).

Dense float64 per head (CPU, a few minutes at 8k). Error: ||o - o_exact|| / ||o_exact|| per layer.

    python -m evals.studies.muse_farfield_study --seq-len 2048 --out evals/results/muse/farfield-study-smollm2-135m-2k-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

import longctx_patch
from evals.shared import SHARED_DATA, result_file
from evals.studies.muse_fidelity import capture_qkv, real_text
from longctx_patch.evals.common import git_commit, size_label
from longctx_patch.kernels.muse.plan import lloyd

GRID = [
    dict(Cq=8, Ck=8, topb=2),
    dict(Cq=32, Ck=32, topb=2),
    dict(Cq=64, Ck=64, topb=2),
    dict(Cq=128, Ck=128, topb=2),
    dict(Cq=64, Ck=64, topb=4),
    dict(Cq=64, Ck=64, topb=2, nosum=True),
    dict(Cq=64, Ck=64, topb=4, nosum=True),
]


def kmeans(x, C, iters):
    cent, a, _ = lloyd(x[None].float(), torch.ones(1, x.shape[0], dtype=torch.bool), C, iters)
    return cent[0].double(), a[0]


def global_far_field(q, k, v, tau, *, L=128, local=1, Cq=64, Ck=64, iters=2, topb=2, nosum=False, qchunk=1024):
    """One head: q, k, v [S, D] float64 -> o [S, D]."""
    S, D = q.shape
    nb = math.ceil(S / L)
    pad = nb * L - S
    blk = torch.arange(S) // L
    qc, qa = kmeans(q, Cq, iters)
    _, ka = kmeans(k, Ck, iters)
    X = tau * qc @ k.T  # [Cq, S] tilt logits at the global query centroids
    mx = X.max(1).values
    E = torch.nn.functional.pad(torch.exp(X - mx[:, None]), (0, pad)).view(Cq, nb, L)
    oh = torch.nn.functional.pad(torch.nn.functional.one_hot(ka, Ck).double(), (0, 0, 0, pad)).view(nb, L, Ck)
    feats = torch.nn.functional.pad(torch.cat([torch.ones(S, 1, dtype=q.dtype), k, v], -1), (0, 0, 0, pad))
    A = torch.einsum("iml,mlj,mlf->imjf", E, oh, feats.view(nb, L, -1))  # per-block partial sums [Cq, nb, Ck, 1+2D]
    ar = torch.arange(nb)
    far = ar[None, :] < (ar[:, None] - local)  # [n, m]
    R = torch.zeros(nb, Cq, nb, dtype=torch.bool)
    if topb > 0:
        mass = A[..., 0].sum(-1)  # [i, m]: exact tilted mass of block m for query cluster i
        sc = torch.where(far[:, None, :], mass[None], torch.full((nb, Cq, nb), -1.0, dtype=A.dtype))
        val, idx = sc.topk(min(topb, nb), -1)
        R.scatter_(-1, idx, val > 0)
    Fs = torch.einsum("nim,imjf->nijf", (far[:, None, :] & ~R).double(), A)  # far-field sums per (n, i, j)
    out = torch.empty_like(v)
    for t0 in range(0, S, qchunk):
        t = torch.arange(t0, min(S, t0 + qchunk))
        n, i = t // L, qa[t]
        exact = ((blk[None] == n[:, None]) & (torch.arange(S)[None] <= t[:, None])) \
            | ((blk[None] < n[:, None]) & (blk[None] >= n[:, None] - local)) | R[n, i][:, blk]
        el = (tau * q[t] @ k.T).masked_fill(~exact, -math.inf)
        Fq = Fs[n, i]
        Z = Fq[..., 0]
        ok = Z > 0
        Zs = torch.where(ok, Z, torch.ones_like(Z))
        kt, vt = Fq[..., 1:1 + D] / Zs[..., None], Fq[..., 1 + D:] / Zs[..., None]
        sl = torch.log(Zs) + mx[i][:, None] + tau * ((q[t] - qc[i])[:, None, :] * kt).sum(-1)
        sl = sl.masked_fill(~ok | nosum, -math.inf)
        p = torch.softmax(torch.cat([el, sl], -1), -1)
        out[t] = p[:, :S] @ v + (p[:, S:, None] * vt).sum(1)
    return out


def layer_error(q, k, v, tau, head=global_far_field, **cfg) -> float:
    """||o - o_exact|| / ||o_exact|| over all heads of one layer, o = head(qh, kh, vh, tau, **cfg) per head."""
    G = q.shape[1] // k.shape[1]
    num = den = 0.0
    S = q.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    for h in range(q.shape[1]):
        qh, kh, vh = q[0, h].double(), k[0, h // G].double(), v[0, h // G].double()
        o = head(qh, kh, vh, tau, **cfg)
        r = torch.softmax((tau * qh @ kh.T).masked_fill(causal, -math.inf), -1) @ vh
        num += ((o - r) ** 2).sum().item()
        den += (r**2).sum().item()
    return math.sqrt(num / den)


def run_study(doc: str, module: str, error_fn, grid, *, seq_len: int, layers: str, kind: str, defaults: dict):
    """The command line of a far-field study: capture SmolLM2's Q/K/V of essays (CPU), error_fn(q, k, v, tau,
    **cfg) per layer and config, one JSON with device, date, commit and command (default
    evals/results/muse/<kind>-smollm2-135m-<seq>-cpu.json)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--data", default=str(SHARED_DATA))
    ap.add_argument("--layers", default=layers)
    ap.add_argument("--grid", default=None, help="JSON list of configs (default: the built-in GRID)")
    ap.add_argument("--out", default=None, help=f"file (default evals/results/muse/{kind}-smollm2-135m-<seq>-cpu.json)")
    args = ap.parse_args()
    out = result_file("muse", f"{kind}-smollm2-135m-{size_label(args.seq_len)}-cpu.json", args.out)
    model, tok = longctx_patch.load_model("smollm2-135m", dtype="float32", device="cpu")
    ids = tok(real_text(Path(args.data), args.seq_len * 8), return_tensors="pt").input_ids[:, : args.seq_len]
    qkv, scale = capture_qkv(model, ids)
    layer_ids = [int(x) for x in args.layers.split(",")]
    rows = []
    for cfg in json.loads(args.grid) if args.grid else grid:
        t0 = time.time()
        errs = [error_fn(*qkv[i], scale, **cfg) for i in layer_ids]
        rows.append(dict(config=cfg, mean_rel_err=sum(errs) / len(errs), per_layer=errs))
        print(f"{json.dumps(cfg):70s} mean {rows[-1]['mean_rel_err']:.4f} "
              f"{[round(e, 4) for e in errs]} ({time.time() - t0:.0f}s)", flush=True)
    res = dict(device="cpu", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=git_commit(), command=f"python -m {module} " + " ".join(sys.argv[1:]),
               model="smollm2-135m", seq_len=int(ids.shape[1]), text="pg_essays", layers=layer_ids,
               defaults=defaults, metric="||o - o_exact|| / ||o_exact||", results=rows)
    out.write_text(json.dumps(res, indent=1))


def main():
    run_study(__doc__, "evals.studies.muse_farfield_study", layer_error, GRID, seq_len=2048, layers="0,3,7,11,15,19,23,27",
              kind="farfield-study", defaults=dict(L=128, local=1, iters=2))


if __name__ == "__main__":
    main()
