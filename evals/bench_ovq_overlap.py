"""OVQ prefill through the op entry point with and without the assignment/attention stream overlap
(`triton_fast.OVERLAP_ASSIGN`), default config except `max_centroids`, against SDPA cuDNN in the same run.

    PYTHONPATH=. python3 evals/bench_ovq_overlap.py --out $OUT/ovq-overlap.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import longctx_patch.kernels.ovq.triton_fast as tf
from longctx_patch.evals.common import git_commit
from longctx_patch.evals.speed import method_op
from longctx_patch.methods import get_method


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,65536")
    ap.add_argument("--centroids", default="1024,4096")
    ap.add_argument("--out", default="evals/results/ovq-overlap.json")
    a = ap.parse_args()
    op = method_op("ovq")
    rows = []
    for S in (int(x) for x in a.lengths.split(",")):
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(1, h, S, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (32, 8, 8))
        kx, vx = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True),
                             return_mode="median")
        for N in (int(x) for x in a.centroids.split(",")):
            cfg = get_method("ovq").parse_config({"max_centroids": N})
            row = dict(S=S, max_centroids=N, chunk_size=cfg.chunk_size, cudnn_ms=cudnn)
            outs = {}
            for ov in (False, True):
                tf.OVERLAP_ASSIGN = ov
                outs[ov] = op(q, k, v, scale=0.125, config=cfg)
                row[f"ovq_ms_overlap_{int(ov)}"] = do_bench(lambda: op(q, k, v, scale=0.125, config=cfg),
                                                           return_mode="median")
            row["max_abs_diff"] = (outs[False].float() - outs[True].float()).abs().max().item()
            row["speedup_vs_cudnn"] = cudnn / row["ovq_ms_overlap_1"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    tf.OVERLAP_ASSIGN = True
    res = dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), commit=git_commit(), command="PYTHONPATH=. python3 evals/bench_ovq_overlap.py "
        + " ".join(sys.argv[1:]), heads="32 query / 8 kv, D=64, bf16, B=1", rows=rows)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
