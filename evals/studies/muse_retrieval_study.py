"""MuSe cells: what lowers the long-context error at a fixed design? A CPU study on SmolLM2-135M's real Q/K/V.

For each layer, the relative error of the attention output against exact attention, for cells plans that differ in
one knob from the defaults of its time (L 256, Ck 16, 16 blocks, 1 sink block; the package has moved since):
- `cq4` / `cq16`: retrieval scored by a count-weighted log-sum over 4 / 16 query sub-centroids of each query block
  (Lloyd on its queries) instead of the block's mean query (the package);
- `b24`: 24 retrieved blocks; `ck32`: 32 cells per block; `ck8b24`: 8 cells and 24 blocks.
The package's reference (`cells_reference`) computes every row; 16k tokens take about 3 minutes per layer on 2 cores.

    python -m evals.studies.muse_retrieval_study --seq-len 16384 --layers 28,7,17,18,3,23,12,0 \
        --out evals/results/muse/retrieval-study-smollm2-135m-16k-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import torch

from evals.shared import SHARED_DATA, model_token, result_file
from longctx_patch.kernels.muse.reference_cells import take_top
from longctx_patch.kernels.muse.plan import block_view
from evals.studies.muse_fidelity import real_qkv
from longctx_patch.evals.common import git_commit, size_label
from longctx_patch.kernels.muse.reference_cells import cell_summaries, cells_reference, make_cells_plan
from longctx_patch.kernels.muse.plan import lloyd, log_counts
from longctx_patch.kernels.softmax import softmax_attention

# name: (k_clusters, topk_blocks, sink_blocks, query sub-centroids for the retrieval score; 1 = the mean query)
VARIANTS = dict(base=(16, 16, 1, 1), cq4=(16, 16, 1, 4), cq16=(16, 16, 1, 16), b24=(16, 24, 1, 1),
                ck32=(32, 16, 1, 1), ck8b24=(8, 24, 1, 1))


def rescored(plan, q, k, scale: float, Cq: int, topk: int, sinks: int):
    """The plan with its retrieved blocks scored at Cq query sub-centroids per (head, query block): block m's score
    is log sum_a n_a sum_c n_c exp(scale q_a . mu_c), an estimate of the attention mass the block's queries put on
    block m (Cq = 1 is the package's mean-query score). No key mask (the study's rows are unpadded)."""
    B, Hq, _, D = q.shape
    L, nb, Sp = plan.block_size, plan.num_blocks, plan.padded_len
    G = Hq // k.shape[1]
    mu = cell_summaries(k, k, plan)[0]
    logn = log_counts(plan.counts)
    valid = plan.key_valid.view(B, 1, nb, L).expand(B, Hq, nb, L)
    cq, _, nq = lloyd(block_view(q, L, Sp).reshape(-1, L, D), valid.reshape(-1, L), Cq, 2, backend="torch")
    cq, nq = cq.view(B, Hq, nb, Cq, D), nq.view(B, Hq, nb, Cq)
    sc = scale * torch.einsum("bhnad,bhmcd->bhnamc", cq, mu.repeat_interleave(G, 1))
    bs = torch.logsumexp(sc + logn.repeat_interleave(G, 1)[:, :, None, None], -1)  # [B, Hq, n, a, m]
    lw = log_counts(nq)
    bs = torch.logsumexp(bs + lw[..., None], 3)  # [B, Hq, n, m]
    ar = torch.arange(nb)
    far = ar[None, :] < ar[:, None] - plan.local_blocks
    sink = ar < sinks
    R = (far & sink[None])[None, None].expand_as(plan.retrieved).clone()
    take_top(R, bs.masked_fill(~far[None, None] | sink[None, None, None], -math.inf), min(topk, nb))
    plan.retrieved = R
    return plan


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--layers", default="28,7,17,18,3,23,12,0")
    ap.add_argument("--data", default=str(SHARED_DATA))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="file (default evals/results/muse/retrieval-study-<model>-<seq>-cpu.json)")
    args = ap.parse_args()
    out = result_file("muse", f"retrieval-study-{model_token(args.model)}-{size_label(args.seq_len)}-cpu.json", args.out)
    torch.manual_seed(0)
    qkv, scale = real_qkv(args.model, args.data, args.seq_len, "cpu")
    layers = [int(x) for x in args.layers.split(",")]
    res = dict(device="cpu", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=git_commit(), command="python -m evals.studies.muse_retrieval_study " + " ".join(sys.argv[1:]),
               model=args.model, seq_len=args.seq_len, text="pg_essays", metric="||o - o_exact|| / ||o_exact||",
               variants={n: dict(k_clusters=c, topk_blocks=t, sink_blocks=s, query_subcentroids=a)
                         for n, (c, t, s, a) in VARIANTS.items()}, per_layer={}, mean={})
    for i in layers:
        q, k, v = qkv[i]
        t0 = time.time()
        ref = softmax_attention(q, k, v, scale=scale)
        row = {}
        for name, (Ck, tb, sinks, Cq) in VARIANTS.items():
            plan = make_cells_plan(q, k, scale=scale, block_size=256, k_clusters=Ck, topk_blocks=tb, sink_blocks=sinks,
                                   kmeans_iters=2, backend="torch")
            if Cq > 1:
                plan = rescored(plan, q, k, scale, Cq, tb, sinks)
            o = cells_reference(q, k, v, plan, scale=scale)
            row[name] = ((o - ref).norm() / ref.norm()).item()
        res["per_layer"][str(i)] = row
        res["mean"] = {n: sum(r[n] for r in res["per_layer"].values()) / len(res["per_layer"]) for n in VARIANTS}
        print(i, {n: round(e, 4) for n, e in row.items()}, f"{time.time() - t0:.0f}s", flush=True)
        out.write_text(json.dumps(res, indent=1))  # after every layer
    print("mean", {n: round(e, 4) for n, e in res["mean"].items()})


if __name__ == "__main__":
    main()
