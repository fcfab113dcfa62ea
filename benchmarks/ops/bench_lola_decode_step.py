"""The kernels of one LoLA / LoLCATs decode step at a decode shape, with their launch settings varied.

A batch-16 decode step of the Llama-3.2-1B-shaped model (32 query / 8 kv heads, D = 64, feature_dim 64, window 64,
chunk 64, sparse cache 256 per kv head; the window buffer holds N keys, 64 <= N < 128 between evictions) runs per
layer: the query feature map (one row per head), the key feature map of the buffered keys attended linearly (up to
63 rows, one with the feature cache), and the step kernel (sparse cache + window + linear state). Each is timed
with `triton.testing.do_bench_cudagraph` for every setting in the sweep, checked against the default setting's output, and
set against its bytes floor (the bytes it must read and write at the measured copy bandwidth).

    python3 -m benchmarks.ops.bench_lola_decode_step --out $OUT/lola-decode-step.json
    TRITON_INTERPRET=1 python3 -m benchmarks.ops.bench_lola_decode_step --smoke   # the script itself, on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shlex
import sys

import torch

from longctx_patch.provenance import device_description, git_commit
from longctx_patch.evals.speed_model import copy_bandwidth


def _time(fn, smoke: bool) -> float:
    """Milliseconds per call, replayed from a CUDA graph: the device time of the kernel as a decode step's graph
    runs it (an eager launch of a Triton kernel costs more host time than these kernels take on the device)."""
    if smoke:
        fn()
        return float("nan")
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=50)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--buffered", default="65,96,127", help="keys in the window buffer (window 64, chunk 64)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one setting each (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from longctx_patch.kernels.lola import reference as ref
    from longctx_patch.kernels.lola import triton_kernels as tk
    from longctx_patch.kernels.lola.tuning import DEFAULT_TUNING

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    B, Hq, Hkv, D, F, L, W = args.batch, 32, 8, 64, 64, 256, 64
    if args.smoke:
        B, Hq, Hkv, D, F, L, W = 2, 4, 2, 16, 8, 8, 4
    F2 = 2 * F
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s, dtype=dt: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
    wq, wk = rnd(Hq, D, F, dtype=torch.float32) / D ** 0.5, rnd(Hq, D, F, dtype=torch.float32) / D ** 0.5
    q = rnd(B, Hq, 1, D)
    Hs = rnd(B, Hq, F2, D, dtype=torch.float32).abs()
    ss = rnd(B, Hq, F2, dtype=torch.float32).abs() + 1
    spk, spv = rnd(B, Hkv, L, D), rnd(B, Hkv, L, D)
    # the sparse slots' scores, as a decode step passes them (valid where finite)
    sp_score = torch.zeros(B, Hkv, L, dtype=torch.float32, device=dev)
    gate = torch.full((Hq,), 0.5, device=dev)
    lf = 1 - gate
    bw = copy_bandwidth(dev) if dev.type == "cuda" else float("nan")
    rows, res = [], {}

    def sweep(name, fn, grid, nbytes):
        """fn(tuning) for each setting of `grid` (a dict of LolaTuning's launch settings, the others the defaults)."""
        base = None
        for combo in grid:
            tuning = DEFAULT_TUNING.replace(**combo)
            try:
                out = fn(tuning)
                ms = _time(lambda: fn(tuning), args.smoke)
                if base is None:
                    base = out.float().clone()
                err = (out.float() - base).abs().max().item()
                row = {"kernel": name, **{k: v for k, v in combo.items() if v is not None}, "us": round(ms * 1e3, 2),
                       "floor_us": round(1e6 * nbytes / bw, 2) if bw == bw else None, "max_diff_vs_default": err}
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result too
                row = {"kernel": name, **combo, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)

    one = [{}] if args.smoke else None
    fm_grid = one or [{}] + [{"fmap_bm": bm, "fmap_warps": w} for bm, w in itertools.product((16, 32, 64), (2, 4))]
    sweep("feature_map q (1 row)", lambda t: tk.feature_map(q, wq, out_dtype=dt, tuning=t), fm_grid,
          q.numel() * q.element_size() + wq.numel() * 4 + B * Hq * F2 * q.element_size())
    for n in [int(x) for x in args.buffered.split(",")] if not args.smoke else [W + 3]:
        k, v = rnd(B, Hkv, n, D), rnd(B, Hkv, n, D)
        nl = n - W
        sweep(f"feature_map k ({nl} rows)", lambda t: tk.feature_map(k[:, :, :nl], wk, out_dtype=dt, tuning=t), fm_grid,
              B * Hkv * nl * D * 2 + wk.numel() * 4 + B * Hq * nl * F2 * 2)
        fq = tk.feature_map(q, wq, out_dtype=dt)
        fk = tk.feature_map(k[:, :, :nl], wk, out_dtype=dt)
        keys = ref.HybridKeys(k, v, fk, Hs, ss, sparse=ref.SparseSet(spk, spv, score=sp_score))
        step = lambda t: tk.decode_step(q, fq, keys, ref.HybridRule(W, gate, lf, D ** -0.5), tuning=t)  # noqa: E731
        grid = one or [{}] + [{"decode_bn": bn, "decode_bk": bk, "decode_warps": w}
                              for bn, bk, w in itertools.product((32, 64), (32, 64, 128), (2, 4))]
        nbytes = (Hs.numel() * 4 + ss.numel() * 4 + sp_score.numel() * 4 + 2 * spk.numel() * 2 + 2 * k.numel() * 2 + fk.numel() * 2
                  + 2 * q.numel() * 2 + fq.numel() * 2)
        sweep(f"decode_step (N={n}, lambda={L})", step, grid, nbytes)
    res.update({
        "task": "decode-attention",  # the LoLA decode step's attention (results/decode/attention-lola-decode-step-*)
        "device": device_description(dev),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "python3 -m benchmarks.ops.bench_lola_decode_step " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "shape": {"batch": B, "q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "feature_dim": F, "sparse_cache": L,
                  "window": W, "dtype": str(dt)},
        "copy_bandwidth_Bps": bw, "rows": rows,
    })
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
