"""A LoLA prefill cut into pieces (what `generate(prefill_chunk_size=...)` does to bound the activations) against one
unbroken prefill, on one layer's `lola_process` (Triton, bf16, the Llama-3.2-1B attention shape: 32 query / 8 kv
heads, D 64, feature_dim 64; lola's defaults window = chunk = 64, 256 sparse pairs per kv head):

    python3 -m benchmarks.ops.bench_lola_continue            # writes $OUT/continue-<gpu>.json (or results/lola/)
    python3 -m benchmarks.ops.bench_lola_continue --cells 16x32768/4096,1x65536/4096

Per cell (batch x tokens / piece): ms of the unbroken prefill (the two-pass path from an empty state), of the
pieces with every continuation on the two-pass path (`prefill.lola_parallel` on the extended sequence), and of
the pieces with the continuations on the chunk loop (the path they took before, CUDA graph per chunk); the peak
memory of each; and the pieces' outputs and final state against the unbroken prefill's (relative error of the
outputs and of H, share of equal sparse pairs). `TRITON_INTERPRET=1 ... --smoke`: tiny shapes on the CPU (the
script's code only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

from benchmarks.shared import device_token, results_dir
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.lola import LolaRun, LolaState, StateSizes, lola_process
from longctx_patch.kernels.lola.tuning import LolaTuning
from longctx_patch.kernels.lola import reference as ref


def _timed(fn, dev, reps: int):
    """Median ms of `reps` calls after one warm-up call, and the peak memory of the last call (GiB above the
    memory allocated before it)."""
    fn()
    times, peak = [], 0.0
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        out = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        times.append((time.perf_counter() - t) * 1e3)
        del out
    return sorted(times)[len(times) // 2], peak


def cell(B, S, piece, *, Hq, Hkv, D, F, window, chunk, lam, dev, reps):
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(B, Hq, S, D, device=dev, generator=g).to(dt)
    k = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(dt)
    v = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(dt)
    Wq = (torch.randn(Hq, D, F, device=dev, generator=g) * D ** -0.25).to(dt)
    Wk = (torch.randn(Hq, D, F, device=dev, generator=g) * D ** -0.25).to(dt)
    fq = ref.hedgehog_feature_map(q, Wq, out_dtype=dt)
    gw = torch.sigmoid(torch.randn(Hq, device=dev, generator=g))
    lf = torch.ones(Hq, device=dev)
    from longctx_patch.kernels.lola import triton_kernels as tk

    phi_k = lambda x: tk.feature_map(x, Wk)  # noqa: E731

    def run(splits, continue_parallel=True):
        st = LolaState.empty(StateSizes(B, Hq, Hkv, D, 2 * F, lam), dt, dev, capacity=window + chunk)
        outs, i = [], 0
        for n in splits:
            tuning = LolaTuning(parallel_prefill=continue_parallel or i == 0)
            lola_run = LolaRun(phi_k=phi_k, window=window, chunk=chunk, lam=lam, scale=D ** -0.5, backend="triton",
                               tuning=tuning)
            outs.append(lola_process(st, q[:, :, i:i + n], k[:, :, i:i + n], v[:, :, i:i + n], fq[:, :, i:i + n],
                                     gw, lf, lola_run))
            i += n
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0], st

    pieces = [piece] * (S // piece) + ([S % piece] if S % piece else [])
    r = {"batch": B, "tokens": S, "piece": piece}
    for name, fn in (("unbroken", lambda: run([S])), ("pieces_two_pass", lambda: run(pieces)),
                     ("pieces_chunk_loop", lambda: run(pieces, continue_parallel=False))):
        r[f"{name}_ms"], r[f"{name}_peak_gib"] = _timed(fn, dev, reps)
    (o1, s1), (o2, s2) = run([S]), run(pieces)

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

    r["pieces_vs_unbroken_out_rel"] = rel(o2, o1)
    r["pieces_vs_unbroken_H_rel"] = rel(s2.H, s1.H)
    # the share of the pieces' sparse pairs that the unbroken prefill keeps too (per row and sparse head, any slot)
    w = torch.randn(2 * D, 1, device=dev, generator=g).double()
    h1, h2 = (torch.cat([st.sp_k, st.sp_v], -1).double() @ w for st in (s1, s2))  # [B, Hs, lam, 1]: a pair's hash
    hit = ((h2 == h1.transpose(-1, -2)) & s1.sp_valid[..., None, :]).any(-1) & s2.sp_valid
    r["pieces_vs_unbroken_sparse_same"] = float(hit.sum() / s2.sp_valid.sum().clamp_min(1))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="16x32768/4096,1x65536/4096,16x32768/8192",
                    help="batch x tokens / piece, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    if a.smoke:
        dev, shape, cells = "cpu", dict(Hq=4, Hkv=2, D=16, F=8, window=16, chunk=16, lam=8), [(1, 112, 48)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
        dev, shape = "cuda", dict(Hq=32, Hkv=8, D=64, F=64, window=64, chunk=64, lam=256)
        cells = [tuple(int(x) for x in c.replace("/", "x").split("x")) for c in a.cells.split(",")]
    res = {"task": "lola-continue", "device": device_description(dev),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "shape": shape, "cells": []}
    out = results_dir("lola", os.environ.get("OUT") or ("/tmp/bench_lola_continue_smoke" if a.smoke else None))
    for B, S, piece in cells:
        r = cell(B, S, piece, dev=dev, reps=1 if a.smoke else a.reps, **shape)
        res["cells"].append(r)
        print(json.dumps(r), flush=True)
        with open(out / f"continue-{device_token()}.json", "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
