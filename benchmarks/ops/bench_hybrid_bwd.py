"""The lolcats hybrid's training path on the GPU: the Triton forward + backward (`HybridAttentionFn`) against the
PyTorch path it replaces (`reference.hybrid_attention_chunked` under autograd), on one SmolLM2-shaped layer.

Checks every gradient (q, k, v, fq, fk, g, lf) of the Triton path against the PyTorch path in fp32 on the same
inputs (relative error of each whole gradient), in bf16 against the fp32 PyTorch path, with a left-padded row; then
times forward + backward of both (`triton.testing.do_bench`, bf16) at the trainer's shape.

    python3 -m benchmarks.ops.bench_hybrid_bwd --out benchmarks/results/lola/train-hybrid-bwd-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch

from benchmarks.shared import result_file
from longctx_patch.provenance import device_description, git_commit
from longctx_patch.kernels.lola import ops
from longctx_patch.kernels.lola import reference as ref
from longctx_patch.kernels.lola.reference import HybridSpec

NAMES = ("q", "k", "v", "fq", "fk", "g", "lf")


def inputs(B, Hq, Hkv, S, D, F, dtype, pad: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v = r(B, Hq, S, D), r(B, Hkv, S, D), r(B, Hkv, S, D)
    wq, wk = r(Hq, D, F) * 0.3, r(Hq, D, F) * 0.3
    fq = ref.hedgehog_feature_map(q, wq)
    fk = ref.hedgehog_feature_map(ref.expand_kv(k, Hq), wk)
    gw, lf = torch.rand(Hq, device="cuda", generator=g), torch.rand(Hq, device="cuda", generator=g)
    km = None
    if pad:
        km = torch.ones(B, S, dtype=torch.bool, device="cuda")
        km[0, :pad] = False
    xs = [t.to(dtype) if i < 5 else t for i, t in enumerate((q, k, v, fq, fk, gw, lf))]
    return [t.detach().requires_grad_(True) for t in xs], km


def grads(path, xs, km, do, window, scale):
    for t in xs:
        t.grad = None
    if path == "triton":
        o = ops.hybrid_attention_triton(*xs, HybridSpec(window=window, scale=scale), key_mask=km)
    else:
        o = ref.hybrid_attention_chunked(*xs, HybridSpec(window=window, scale=scale), key_mask=km).transpose(1, 2)
    o.float().backward(do)
    return o.detach().float(), [t.grad.detach().float().clone() for t in xs]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# the backward's settings (kernels/lola/tuning.LolaTuning), every combination of keys per prefix state x (dq, dkv) warps x stages
SWEEP = [{"train_state_chunk": cs, "bwd_dq_warps": wq, "bwd_dkv_warps": wkv, "bwd_stages": st}
         for cs in (64, 128, 256) for wq, wkv in ((4, 4), (8, 8), (4, 8), (8, 4)) for st in (1, 2, 3)]
# the forward's tiles (train_block_m / train_block_n, which the backward takes too) and launch settings
SWEEP_FWD = [{"train_block_m": bm, "train_block_n": bn, "hybrid_num_warps": w, "hybrid_num_stages": st}
             for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for st in (1, 2)]


def sweep(xs, do, window, scale, settings=None, time_fwd: bool = False):
    """Forward + backward time of the training pass (and with `time_fwd` the training forward alone, its graph
    dropped) for every setting of `settings` (default SWEEP; bf16, the timing shape), the others at their defaults.
    Each setting's gradients are compared with the defaults' (relative error of each whole gradient; settings only
    reorder fp32 sums, so a large one is a bug). Each setting is passed to the kernels as a LolaTuning (`tuning=`).
    Returns (rows, the fastest forward + backward's row)."""
    import triton.testing

    from longctx_patch.kernels.lola.tuning import DEFAULT_TUNING

    settings = SWEEP if settings is None else settings

    def fwd(tuning=DEFAULT_TUNING):
        ops.hybrid_attention(*xs, HybridSpec(window=window, scale=scale, tuning=tuning))

    def run(tuning=DEFAULT_TUNING):
        for t in xs:
            t.grad = None
        ops.hybrid_attention(*xs, HybridSpec(window=window, scale=scale, tuning=tuning)).backward(do)

    run()
    ref_grads = [t.grad.float().clone() for t in xs]
    rows = []
    for setting in settings:
        tuning = DEFAULT_TUNING.replace(**setting)
        row = dict(setting)
        try:
            run(tuning)
            err = max(rel(t.grad.float(), g) for t, g in zip(xs, ref_grads))
            if time_fwd:
                row["fwd_ms"] = triton.testing.do_bench(lambda: fwd(tuning))
            row.update(fwd_bwd_ms=triton.testing.do_bench(lambda: run(tuning)), max_rel_err_vs_default=err)
        except Exception as e:  # a setting that does not compile (shared memory) is a row too
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    ok = [r for r in rows if "fwd_bwd_ms" in r and r["max_rel_err_vs_default"] < 3e-2]
    return rows, min(ok, key=lambda r: r["fwd_bwd_ms"]) if ok else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", default="9,3", help="query heads, kv heads (SmolLM2: 9,3)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="also a torch.profiler table of one Triton forward + "
                    "backward (the kernels and torch ops with the most device time)")
    ap.add_argument("--sweep", action="store_true", help="also time the training pass (forward + backward) over a grid "
                    "of its settings (kernels/lola/tuning.LolaTuning: train_state_chunk, bwd_dq_warps, bwd_dkv_warps, bwd_stages), each "
                    "checked against the default settings' gradients; the fastest goes to the record's 'best'")
    ap.add_argument("--sweep-fwd", action="store_true", help="also time the training pass over a grid of the forward's "
                    "settings (LolaTuning: train_block_m, train_block_n, hybrid_num_warps, hybrid_num_stages), each checked "
                    "against the defaults' gradients; the fastest goes to the record's 'best_fwd'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    import triton.testing

    Hq, Hkv = (int(x) for x in args.heads.split(","))
    B, S, D, F, W = args.batch, args.seq, 64, 64, args.window
    scale = D ** -0.5
    rec = {"task": "lola-train-hybrid-bwd",
           "device": device_description("cuda"), "date": datetime.date.today().isoformat(), "commit": git_commit(),
           "command": "python3 -m benchmarks.ops.bench_hybrid_bwd " + shlex.join(sys.argv[1:]),
           "shape": {"B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "F2": 2 * F, "window": W}}
    # correctness: fp32 Triton vs fp32 PyTorch; bf16 Triton vs fp32 PyTorch (a left-padded row in both)
    check = {}
    x32, km = inputs(2, Hq, Hkv, 1024, D, F, torch.float32, pad=100)
    do = torch.randn(2, 1024, Hq, D, device="cuda")
    o_ref, g_ref = grads("torch", x32, km, do, W, scale)
    for dt in (torch.float32, torch.bfloat16):
        xs, _ = inputs(2, Hq, Hkv, 1024, D, F, dt, pad=100)
        o, gs = grads("triton", xs, km, do, W, scale)
        check[str(dt).split(".")[-1]] = {"out": rel(o, o_ref), **{n: rel(a, b) for n, a, b in zip(NAMES, gs, g_ref)}}
    rec["relative_error_vs_torch_fp32"] = check
    print(json.dumps(check, indent=1))
    # speed at the trainer's shape, bf16
    xs, _ = inputs(B, Hq, Hkv, S, D, F, torch.bfloat16, pad=0)
    do = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    times = {}
    spec = HybridSpec(window=W, scale=scale)
    for path in ("triton", "torch"):
        def fwd():
            with torch.no_grad():
                if path == "triton":
                    ops.hybrid_attention_triton(*xs, spec)
                else:
                    ref.hybrid_attention_chunked(*xs, spec)

        def fwd_bwd():
            for t in xs:
                t.grad = None
            if path == "triton":
                o = ops.hybrid_attention_triton(*xs, spec)
            else:
                o = ref.hybrid_attention_chunked(*xs, spec).transpose(1, 2)
            o.backward(do.to(o.dtype))

        torch.cuda.reset_peak_memory_stats()
        times[path] = {"fwd_ms": triton.testing.do_bench(fwd), "fwd_bwd_ms": triton.testing.do_bench(fwd_bwd),
                       "peak_mib": torch.cuda.max_memory_allocated() / 2 ** 20}
    times["speedup_fwd_bwd"] = times["torch"]["fwd_bwd_ms"] / times["triton"]["fwd_bwd_ms"]
    # what the whole model's attention would cost per token: 30 layers of SmolLM2
    times["tokens_per_s_attention_only_30_layers"] = B * S / (30 * times["triton"]["fwd_bwd_ms"] / 1e3)
    rec["timing_bf16"] = times
    if args.sweep:
        rec["sweep"], rec["best"] = sweep(xs, do, W, scale)
    if args.sweep_fwd:
        rec["sweep_fwd"], rec["best_fwd"] = sweep(xs, do, W, scale, SWEEP_FWD, time_fwd=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for t in xs:
            t.grad = None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            o = ops.hybrid_attention_triton(*xs, spec)
            o.backward(do)
            torch.cuda.synchronize()
        evs = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:15]
        rec["profile"] = [{"op": e.key[:120], "calls": e.count, "device_ms": e.self_device_time_total / 1e3}
                          for e in evs]
        for r in rec["profile"]:
            print(f"  {r['device_ms']:8.3f} ms x{r['calls']:4d} {r['op']}")
    print(json.dumps(times, indent=1))
    out = result_file("lola", "train-hybrid-bwd-h200.json", args.out)
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
