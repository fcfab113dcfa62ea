"""Is the LoLA Triton prefill deterministic? Runs the same fresh prefill (the check of evals/bench/bench_lola.py: B=2,
8/2 heads, D=64, 777 tokens, left padding in row 1, window 32, chunk 64, lambda 16) several times with the
Triton kernels and compares each run with the PyTorch backend, run chunk by chunk so that the sparse set after
every eviction can be compared with the Triton path's (PrefillEvictions.SPSC). Prints and writes, per run: the
relative error of the output, the chunks whose queries differ, and the first eviction whose kept scores differ.

    python3 -m evals.device.lola_determinism [--reps 3] [--dtype float32] [--lolcats-first] [--out FILE]

Start it while other work runs on the same GPU to test under load. On 2026-11-30 it showed a shared-memory race in
the eviction fold (8 of 12 runs diverged under load; fixed in b12964d, then 0 of 12):
evals/results/lola/determinism-fix-h200.json and docs/PERFORMANCE.md (section LoLA).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from evals.bench import bench_lola as bl  # shapes, make(), rel(), the kernels' modules
from longctx_patch.evals.common import git_commit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lolcats-first", action="store_true", help="run the LoLCATs hybrid first, as bench_lola's check")
    ap.add_argument("--seq", type=int, default=777)
    ap.add_argument("--no-graph", action="store_true", help="run the evictions eagerly (no CUDA graph)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tk = bl.tk
    stash = []
    run = tk.PrefillEvictions.run

    def keep(self, graph=True):
        stash.append(self)
        return run(self, graph)

    tk.PrefillEvictions.run = keep
    if args.no_graph:
        from longctx_patch.kernels.lola import ops

        ops.GRAPH_PREFILL = False
    dtype, D, S0, dev = getattr(torch, args.dtype), 64, args.seq, bl.DEV
    rows = []
    for rep in range(args.reps):
        q, k, v, fq, fk, g, lf, _, Wk = bl.make(2, 8, 2, S0, D, 32, dtype, seed=D)
        km = torch.ones(2, S0, dtype=torch.bool, device=dev)
        km[1, :50] = False
        if args.lolcats_first:
            bl.hybrid_attention(q, k, v, fq, fk, g, lf, window=64, scale=D ** -0.5, key_mask=km, backend="triton")
        phi_k = lambda x: bl.ref.hedgehog_feature_map(x, Wk, out_dtype=dtype)  # noqa: E731
        stash.clear()
        st = bl.LolaState.empty(2, 8, 2, D, 64, 16, dtype, dev)
        o_t = bl.lola_process(st, q, k, v, fq, g, lf, phi_k=phi_k, window=32, chunk=64, lam=16, scale=D ** -0.5,
                              key_mask_new=km, backend="triton")
        ev = stash[0] if stash else None
        st = bl.LolaState.empty(2, 8, 2, D, 64, 16, dtype, dev)
        outs, scores, states = [], [], []
        for c0 in range(0, S0, 64):
            sl = slice(c0, min(c0 + 64, S0))
            outs.append(bl.lola_process(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], fq[:, :, sl], g, lf,
                                        phi_k=phi_k, window=32, chunk=64, lam=16, scale=D ** -0.5,
                                        key_mask_new=km[:, sl], backend="torch"))
            scores.append(st.sp_score.sort(-1, descending=True).values.clone())
            states.append(st.H.clone())  # after eviction c (when chunk c is full)
        o_r = torch.cat(outs, 1)
        err = (o_t.float() - o_r.float()).abs().amax(dim=(-1, -2)) * km
        row = {"rep": rep, "rel_err": bl.rel(o_t[km], o_r[km]),
               "graph": ev is not None and ev.graph is not None,
               "chunks_differing": sorted({int(p) // 64 for p in torch.nonzero(err > 1e-3)[:, 1]}),
               "first_eviction_differing": None, "first_state_differing": None}
        if ev is not None:
            for c in range(ev.n_ev):
                a = ev.SPSC[c + 1].sort(-1, descending=True).values
                d = (a - scores[c]).abs().nan_to_num(0, 0, 0).max().item()
                if d > 1e-4 or not torch.isinf(a).eq(torch.isinf(scores[c])).all():
                    row["first_eviction_differing"] = {"eviction": c, "max_score_diff": d,
                                                       "triton_top4": a[0, 0, :4].tolist(),
                                                       "torch_top4": scores[c][0, 0, :4].tolist()}
                    break
            for c in range(ev.n_ev):  # the linear state after eviction c: H_all[c + 1] against the loop's H
                e = bl.rel(ev.H_all[c + 1], states[c])
                if e > 1e-5:
                    row["first_state_differing"] = {"eviction": c, "rel_err": e}
                    break
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = {"task": "lola-determinism", "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "command": "python3 -m evals.device.lola_determinism " + " ".join(sys.argv[1:]),
           "dtype": args.dtype, "lolcats_first": args.lolcats_first, "graph": not args.no_graph, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
